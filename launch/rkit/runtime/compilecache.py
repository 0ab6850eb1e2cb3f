"""JAX's persistent compilation cache as a rank uses it (MaxText's jax_cache_dir, which rkit sets): what a restart
finds there. Two of JAX's defaults make a restart compile again what the run compiled before:

- JAX keeps only the compilations that took a second or more (cache_every_compilation);
- JAX writes entries only from process 0 ("contention for writes on some filesystems, e.g. GCS",
  jax/_src/compiler.py `_cache_write`), and on the CPU backend each process's executable has its own key (the key
  hashes the process's own devices and compile options): process 0's entry never serves process 1, which compiled
  MaxText's init and train step again at every start, 6.6 s of a 10 s restart on the tiny model while process 0
  loaded both in 0.4 s and waited for it (docs/benchmarks.md "Restart latency"). On the CPU backend rkit lets every
  process write its own (cache_every_process); on a GPU or TPU JAX's rule stays.
"""

from __future__ import annotations

import inspect
import os
import warnings

CACHE_MIN_COMPILE_ENV = "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"
# JAX's private writer, as the pinned JAX (containers/lock) has it: another signature leaves JAX's rule in place.
CACHE_WRITE_PARAMETERS = ["cache_key", "compile_time_secs", "module_name", "backend", "executable"]


def cache_every_compilation(environ: dict[str, str] | os._Environ) -> bool:
    """JAX's persistent compile cache keeps only the compilations that took a second or more
    (jax_persistent_cache_min_compile_time_secs=1.0); every restart compiles the rest again. rkit keeps them all,
    so that an attempt after a fault compiles nothing the run compiled before (tiny model on 2 CPU processes: its
    restart's compile part 8.3 -> 6.8 s, docs/benchmarks.md "Restart latency"). A user's own
    JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS is left as it is. Returns whether rkit set it."""
    if environ.get(CACHE_MIN_COMPILE_ENV):
        return False
    import jax

    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    return True


def cache_every_process() -> bool:
    """Every process of a CPU run writes its own entries to JAX's persistent cache (process 0 alone does
    otherwise), so that a restart's process 1 loads what it compiled before instead of compiling it again. The
    entries are the ones JAX would write (its threshold, its writer `put_executable_and_time`, a failed write a
    warning); the other backends' writes go through JAX's own rule. Returns whether it is in place (False where
    JAX's private writer is not the one this was written against: its rule then stays)."""
    from jax._src import compilation_cache, compiler, config, distributed

    jax_write = getattr(compiler, "_cache_write", None)
    if getattr(jax_write, "rkit_every_process", False):
        return True
    if jax_write is None or list(inspect.signature(jax_write).parameters) != CACHE_WRITE_PARAMETERS:
        return False

    def write(cache_key, compile_time_secs, module_name, backend, executable):
        if distributed.global_state.process_id == 0 or getattr(backend, "platform", None) != "cpu":
            return jax_write(cache_key, compile_time_secs, module_name, backend, executable)
        if compile_time_secs < config.persistent_cache_min_compile_time_secs.value:
            return None
        try:
            compilation_cache.put_executable_and_time(cache_key, module_name, executable, backend,
                                                      int(compile_time_secs))
        except Exception as ex:  # as JAX's writer: a cache that cannot be written costs only the next compile
            warnings.warn(f"Error writing persistent compilation cache entry for '{module_name}': "
                          f"{type(ex).__name__}: {ex}", stacklevel=2)
        return None

    write.rkit_every_process = True
    compiler._cache_write = write
    return True
