"""JAX's persistent compilation cache as a restart finds it (runtime/compilecache): every compilation kept, and on
the CPU backend every process's own entries written, checked with two real jax.distributed processes."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

from rkit.runtime import compilecache

from ..conftest import free_port


def test_every_compilation_is_cached_unless_the_user_set_jaxs_threshold():
    import jax

    before = jax.config.jax_persistent_cache_min_compile_time_secs
    try:
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 1.0)
        assert not compilecache.cache_every_compilation({compilecache.CACHE_MIN_COMPILE_ENV: "2.5"})
        assert jax.config.jax_persistent_cache_min_compile_time_secs == 1.0  # the user's, as JAX read it
        assert compilecache.cache_every_compilation({})
        assert jax.config.jax_persistent_cache_min_compile_time_secs == 0.0
    finally:
        jax.config.update("jax_persistent_cache_min_compile_time_secs", before)


# One process of two: a program over both processes' devices compiled, JAX's in-memory caches cleared, compiled
# again (what a restart does), first under JAX's own rule and then with rkit's; it prints the persistent cache's
# hits of each second compile.
PROCESS = textwrap.dedent("""
    import json, sys
    import jax
    from jax.sharding import NamedSharding, PartitionSpec
    from rkit.runtime.compilecache import cache_every_compilation, cache_every_process

    port, rank, cache = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=2, process_id=rank)
    jax.config.update("jax_compilation_cache_dir", cache)
    cache_every_compilation({})
    hits = []
    jax.monitoring.register_event_listener(lambda event, **_: hits.append(event))
    mesh = jax.make_mesh((2,), ("d",))
    x = jax.make_array_from_callback((4,), NamedSharding(mesh, PartitionSpec("d")),
                                     lambda index: jax.numpy.arange(4.0)[index])

    def restart_hits(scale):
        step = jax.jit(lambda a: (a * scale).sum())
        step(x).block_until_ready()
        jax.clear_caches()
        hits.clear()
        step(x).block_until_ready()
        return hits.count("/jax/compilation_cache/cache_hits")

    jax_rule = restart_hits(2.0)
    installed = cache_every_process()
    print(json.dumps({"jax": jax_rule, "installed": installed, "rkit": restart_hits(3.0)}))
""")


def test_every_cpu_process_finds_its_own_compilations_after_a_restart(tmp_path: Path):
    port = str(free_port())
    procs = [subprocess.Popen([sys.executable, "-c", PROCESS, port, str(rank), str(tmp_path / "cache")],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for rank in (0, 1)]
    outs = [proc.communicate(timeout=300) for proc in procs]
    assert [proc.returncode for proc in procs] == [0, 0], [err[-2000:] for _, err in outs]
    rank0, rank1 = (json.loads(out.strip().splitlines()[-1]) for out, _ in outs)
    # JAX's rule: process 1's entries are never written, so its restart compiles again; rkit's: both load
    assert rank0 == {"jax": 1, "installed": True, "rkit": 1} and rank1 == {"jax": 0, "installed": True, "rkit": 1}
