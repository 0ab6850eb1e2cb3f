"""The GPU health check's parsers and verdicts on the vendors' documented outputs (gpu_health.py); the
supervisor's side (an unfit node excluded like a dead one) is in test_attempt_loop.py."""

from __future__ import annotations

import json

from rkit.backends import gpu_health

NVIDIA_ECC = "0, 0\n1, [N/A]\n2, 3\n3, 0\n"
NVIDIA_APPS = "4242, /usr/bin/python3, 00000000:07:00.0\n"
AMD_ECC = json.dumps([
    {"gpu": 0, "ecc": {"total_correctable_count": 12, "total_uncorrectable_count": 0,
                       "total_deferred_count": 4}},
    {"gpu": 1, "ecc": {"total_correctable_count": 0, "total_uncorrectable_count": 2}},
])
AMD_PROCESSES_NONE = json.dumps([{"gpu": 0, "process_list": [{"process_info": "No running processes detected"}]}])
AMD_PROCESSES = json.dumps([{"gpu": 5, "process_list": [{"process_info": {"name": "python3", "pid": 911,
                                                                          "memory_usage": {"vram_mem": 1024}}}]}])


def test_nvidia_uncorrectable_ecc_and_leftover_processes_fail_a_node():
    assert gpu_health.nvidia_ecc(NVIDIA_ECC) == {"0": 0, "2": 3, "3": 0}  # [N/A]: no ECC on that GPU
    assert gpu_health.verdict("nvidia", "0, 0\n1, 0\n", "") is None
    assert gpu_health.verdict("nvidia", NVIDIA_ECC, NVIDIA_APPS) == (
        "uncorrectable ECC errors on GPU 2 (3); 1 process(es) still holding GPUs: "
        "pid 4242 /usr/bin/python3 on 00000000:07:00.0")


def test_amd_uncorrectable_ecc_and_processes_fail_a_node_and_deferred_or_correctable_do_not():
    assert gpu_health.amd_ecc(AMD_ECC) == {"0": 0, "1": 2}
    assert gpu_health.amd_processes(AMD_PROCESSES_NONE) == []
    assert gpu_health.verdict("amd", json.dumps([{"gpu": 0, "ecc": {"total_uncorrectable_count": 0}}]),
                              AMD_PROCESSES_NONE) is None
    assert gpu_health.verdict("amd", AMD_ECC, AMD_PROCESSES) == (
        "uncorrectable ECC errors on GPU 1 (2); 1 process(es) still holding GPUs: pid 911 python3")
    assert gpu_health.amd_ecc("WARNING: something\n" + AMD_ECC) == {"0": 0, "1": 2}  # a warning line first
    assert gpu_health.amd_ecc("not json") == {}


def test_the_check_step_gives_each_node_its_own_lines():
    argv = gpu_health.step_argv(["a", "b"], gpu_health.QUERIES["nvidia"]["ecc"])
    assert argv[:6] == ["srun", "--nodes=2", "--ntasks=2", "--ntasks-per-node=1", "--nodelist=a,b", "--label"]
    assert argv[-3:] == gpu_health.QUERIES["nvidia"]["ecc"]
    assert gpu_health.by_node(["a", "b"], "0: 0, 0\n1: 0, 5\n1: 1, 0\n") == {"a": "0, 0", "b": "0, 5\n1, 0"}


def test_a_check_that_cannot_run_says_why_and_fails_no_node(tmp_path):
    found, why = gpu_health.check(None, "nvidia", env={"PATH": str(tmp_path)})
    assert found == {} and "nvidia-smi could not run" in why


def test_a_tool_off_the_path_is_named_by_its_variable(tmp_path):
    smi = tmp_path / "nvidia-smi"
    smi.write_text('#!/bin/sh\ncase "$1" in --query-gpu=*) echo "0, 2" ;; esac\n')
    smi.chmod(0o755)
    found, why = gpu_health.check(None, "nvidia", env={"PATH": "/nonexistent", "RKIT_NVIDIA_SMI": str(smi)})
    assert why is None and found == {"localhost": "uncorrectable ECC errors on GPU 0 (2)"}
