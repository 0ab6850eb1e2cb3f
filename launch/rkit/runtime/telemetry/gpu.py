"""GPUs of a node, read through the cheapest source present, probed once: NVML (pynvml, from nvidia-ml-py),
amd-smi's Python library, the amdgpu sysfs files, then the rocm-smi command. sysfs comes before rocm-smi on
purpose: it holds the same numbers without starting a process per sample. With none of them the sample says
`"gpu_backend": "absent", "gpus": []`, silently: a CPU node is not an error.
"""

from __future__ import annotations

import importlib
import json
import os
import shutil
import subprocess
import threading
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Protocol

SYSFS_DRM = Path("/sys/class/drm")
ROCM_SMI_TIMEOUT = 10.0
GPU_BACKEND_ENV = "RKIT_GPU_BACKEND"  # force one backend ("absent" turns GPU probing off)
MIB = 1 << 20


class GpuProbe(Protocol):
    name: str

    def read(self) -> list[dict[str, Any]]: ...


def _gpu(index: int, name: str | None, util: Any = None, used: Any = None, total: Any = None, temp: Any = None,
         power: Any = None, ecc: Any = None) -> dict[str, Any]:
    return {"index": index, "name": name, "utilization_percent": _num(util), "memory_used_bytes": _int(used),
            "memory_total_bytes": _int(total), "temperature_c": _num(temp), "power_w": _num(power),
            "ecc_errors": _int(ecc)}


def _num(value: Any) -> float | None:
    """Vendor libraries answer "N/A" (or raise) for what a device does not support: that becomes null."""
    if isinstance(value, bool) or value is None:
        return None
    try:
        return round(float(value), 3)
    except (TypeError, ValueError):
        return None


def _int(value: Any) -> int | None:
    number = _num(value)
    return None if number is None else int(number)


class _Fields:
    """Remembers what a device refused once, so an unsupported query costs one exception, not one per sample."""

    def __init__(self) -> None:
        self.unsupported: set[tuple[int, str]] = set()

    def get(self, index: int, field: str, read: Callable[[], Any]) -> Any:
        if (index, field) in self.unsupported:
            return None
        try:
            return read()
        except Exception:  # noqa: BLE001 - each vendor library has its own error classes; all mean "not here"
            self.unsupported.add((index, field))
            return None


class AbsentProbe:
    name = "absent"

    def read(self) -> list[dict[str, Any]]:
        return []


ABSENT = AbsentProbe()


class NvmlProbe:
    """NVIDIA GPUs through NVML: a library call per value, no process."""

    name = "nvml"

    def __init__(self, nvml: Any):
        self.nvml = nvml
        nvml.nvmlInit()
        self.handles = [nvml.nvmlDeviceGetHandleByIndex(i) for i in range(nvml.nvmlDeviceGetCount())]
        self.fields = _Fields()
        self.names = [self.fields.get(i, "name", lambda h=h: _text(nvml.nvmlDeviceGetName(h)))
                      for i, h in enumerate(self.handles)]

    @classmethod
    def open(cls, import_module: Callable[[str], Any] = importlib.import_module) -> NvmlProbe | None:
        try:
            nvml = import_module("pynvml")
            probe = cls(nvml)  # nvmlInit fails where there is no driver (libnvidia-ml.so missing)
        except Exception:  # noqa: BLE001 - ImportError, NVMLError_LibraryNotFound, ...: no NVIDIA GPUs here
            return None
        return probe if probe.handles else None

    def read(self) -> list[dict[str, Any]]:
        nvml, get = self.nvml, self.fields.get
        out = []
        for i, h in enumerate(self.handles):
            memory = get(i, "memory", lambda h=h: nvml.nvmlDeviceGetMemoryInfo(h))
            power_mw = get(i, "power", lambda h=h: nvml.nvmlDeviceGetPowerUsage(h))
            out.append(_gpu(
                i, self.names[i],
                util=get(i, "util", lambda h=h: nvml.nvmlDeviceGetUtilizationRates(h).gpu),
                used=getattr(memory, "used", None), total=getattr(memory, "total", None),
                temp=get(i, "temp", lambda h=h: nvml.nvmlDeviceGetTemperature(h, nvml.NVML_TEMPERATURE_GPU)),
                power=None if power_mw is None else power_mw / 1000.0,
                # Uncorrectable errors since the driver loaded: the ones that crash a job.
                ecc=get(i, "ecc", lambda h=h: nvml.nvmlDeviceGetTotalEccErrors(
                    h, nvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, nvml.NVML_VOLATILE_ECC))))
        return out


def _text(value: Any) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)


class AmdSmiProbe:
    """AMD GPUs through amd-smi's Python library (ROCm 6+)."""

    name = "amdsmi"

    def __init__(self, amdsmi: Any):
        self.amdsmi = amdsmi
        flags = getattr(getattr(amdsmi, "AmdSmiInitFlags", None), "INIT_AMD_GPUS", None)
        amdsmi.amdsmi_init(flags) if flags is not None else amdsmi.amdsmi_init()
        self.handles = list(amdsmi.amdsmi_get_processor_handles())
        self.fields = _Fields()
        self.names = [self.fields.get(i, "name", lambda h=h: amdsmi.amdsmi_get_gpu_asic_info(h)["market_name"])
                      for i, h in enumerate(self.handles)]

    @classmethod
    def open(cls, import_module: Callable[[str], Any] = importlib.import_module) -> AmdSmiProbe | None:
        try:
            probe = cls(import_module("amdsmi"))
        except Exception:  # noqa: BLE001 - no library, or no amdgpu driver
            return None
        return probe if probe.handles else None

    def _temperature(self, h: Any) -> Any:
        a = self.amdsmi
        # MI300-class parts report no edge sensor; the hotspot (junction) one is what throttles.
        for sensor in ("HOTSPOT", "EDGE"):
            try:
                value = a.amdsmi_get_temp_metric(h, getattr(a.AmdSmiTemperatureType, sensor),
                                                 a.AmdSmiTemperatureMetric.CURRENT)
            except Exception:  # noqa: BLE001 - this sensor is not there; try the next
                continue
            if _num(value) is not None:
                return value
        raise LookupError("no temperature sensor")

    def read(self) -> list[dict[str, Any]]:
        a, get = self.amdsmi, self.fields.get
        out = []
        for i, h in enumerate(self.handles):
            vram = get(i, "vram", lambda h=h: a.amdsmi_get_gpu_vram_usage(h)) or {}
            power = get(i, "power", lambda h=h: a.amdsmi_get_power_info(h)) or {}
            watts = next((power[k] for k in ("socket_power", "current_socket_power", "average_socket_power")
                          if _num(power.get(k)) is not None), None)
            ecc = get(i, "ecc", lambda h=h: a.amdsmi_get_gpu_total_ecc_count(h)) or {}
            out.append(_gpu(
                i, self.names[i],
                util=(get(i, "util", lambda h=h: a.amdsmi_get_gpu_activity(h)) or {}).get("gfx_activity"),
                used=_mib(vram.get("vram_used")), total=_mib(vram.get("vram_total")),  # amd-smi says MiB
                temp=get(i, "temp", lambda h=h: self._temperature(h)), power=watts,
                ecc=ecc.get("uncorrectable_count")))
        return out


def _mib(value: Any) -> int | None:
    number = _num(value)
    return None if number is None else int(number * MIB)


class SysfsProbe:
    """AMD GPUs through the amdgpu driver's files: gpu_busy_percent, mem_info_vram_*, hwmon, ras."""

    name = "sysfs"

    def __init__(self, devices: list[Path]):
        self.devices = devices
        self.names = [self._name(d) for d in devices]
        self.hwmon = [next(iter(sorted(d.glob("hwmon/hwmon*"))), None) for d in devices]
        self.temp_files = [self._temp_file(h) for h in self.hwmon]

    @classmethod
    def open(cls, root: Path = SYSFS_DRM) -> SysfsProbe | None:
        try:
            cards = sorted((p for p in root.glob("card*") if p.name[4:].isdigit()), key=lambda p: int(p.name[4:]))
        except OSError:
            return None
        devices = [c / "device" for c in cards if (c / "device" / "gpu_busy_percent").is_file()]
        return cls(devices) if devices else None

    @staticmethod
    def _name(device: Path) -> str | None:
        product = _read(device / "product_name")
        if product:
            return product
        ident = _read(device / "device")
        return f"amdgpu {ident}" if ident else "amdgpu"

    @staticmethod
    def _temp_file(hwmon: Path | None) -> Path | None:
        if hwmon is None:
            return None
        # The junction (hotspot) sensor when labelled, else the first: it is the one that throttles.
        for label in sorted(hwmon.glob("temp*_label")):
            if _read(label) == "junction":
                return label.with_name(label.name.replace("_label", "_input"))
        first = hwmon / "temp1_input"
        return first if first.exists() else None

    def read(self) -> list[dict[str, Any]]:
        out = []
        for i, device in enumerate(self.devices):
            hwmon, temp_file = self.hwmon[i], self.temp_files[i]
            temp = _read_num(temp_file) if temp_file else None
            power = None
            if hwmon is not None:
                power = _read_num(hwmon / "power1_average")
                power = _read_num(hwmon / "power1_input") if power is None else power
            out.append(_gpu(
                i, self.names[i], util=_read_num(device / "gpu_busy_percent"),
                used=_read_num(device / "mem_info_vram_used"), total=_read_num(device / "mem_info_vram_total"),
                temp=None if temp is None else temp / 1000.0,  # millidegrees Celsius
                power=None if power is None else power / 1e6,  # microwatts
                ecc=_ras_uncorrectable(device / "ras" / "umc_err_count")))
        return out


def _read(path: Path) -> str | None:
    try:
        return path.read_text(encoding="utf-8", errors="replace").strip()
    except OSError:
        return None


def _read_num(path: Path) -> float | None:
    return _num(_read(path))


def _ras_uncorrectable(path: Path) -> int | None:
    """ras/umc_err_count reads "ue: N\\nce: M"."""
    text = _read(path)
    for line in (text or "").splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "ue":
            return _int(value.strip())
    return None


class RocmSmiProbe:
    """The last resort on AMD: the rocm-smi command, one process per sample (argv list, bounded by a timeout)."""

    name = "rocm-smi"
    ARGS = ("--showuse", "--showmeminfo", "vram", "--showtemp", "--showpower", "--showproductname", "--json")

    def __init__(self, exe: str):
        self.exe = exe

    @classmethod
    def open(cls, exe: str | None = None) -> RocmSmiProbe | None:
        exe = exe or shutil.which("rocm-smi")
        if not exe:
            return None
        probe = cls(exe)
        return probe if probe.read() else None

    def read(self) -> list[dict[str, Any]]:
        try:
            done = subprocess.run([self.exe, *self.ARGS], capture_output=True, text=True, timeout=ROCM_SMI_TIMEOUT,
                                  check=False, stdin=subprocess.DEVNULL)
            cards = json.loads(done.stdout)
        except (OSError, subprocess.TimeoutExpired, ValueError):
            return []
        if not isinstance(cards, dict):
            return []
        return [self._card(i, card) for i, (_, card) in
                enumerate(sorted(((k, v) for k, v in cards.items() if k.startswith("card") and isinstance(v, dict)),
                                 key=lambda kv: int(kv[0][4:]) if kv[0][4:].isdigit() else 0))]

    @staticmethod
    def _card(index: int, card: dict) -> dict[str, Any]:
        def find(*words: str) -> Any:
            # rocm-smi's JSON keys change between releases ("Temperature (Sensor junction) (C)", ...).
            for key, value in card.items():
                if all(w in key.lower() for w in words):
                    return value
            return None

        temp = find("temperature", "junction")
        return _gpu(index, find("card series") or find("card model"), util=find("gpu use"),
                    used=find("vram total used memory"), total=find("vram total memory"),
                    temp=temp if temp is not None else find("temperature", "edge"),
                    power=find("power", "(w)"), ecc=None)


def detect_gpu(*, sysfs_root: Path = SYSFS_DRM, environ: Mapping[str, str] | None = None) -> GpuProbe:
    """The first GPU source that works on this node, or ABSENT; errors are the normal answer on a CPU node."""
    env = os.environ if environ is None else environ
    forced = env.get(GPU_BACKEND_ENV, "")
    openers: dict[str, Callable[[], GpuProbe | None]] = {
        "nvml": NvmlProbe.open, "amdsmi": AmdSmiProbe.open, "sysfs": lambda: SysfsProbe.open(sysfs_root),
        "rocm-smi": RocmSmiProbe.open}
    if forced == "absent":
        return ABSENT
    for name, opener in openers.items():
        if forced and name != forced:
            continue
        probe = opener()
        if probe is not None:
            return probe
    return ABSENT


_default_gpu: GpuProbe | None = None
_default_lock = threading.Lock()


def default_gpu() -> GpuProbe:
    """This process's GPU probe, detected once (NVML and amd-smi keep a session open)."""
    global _default_gpu
    with _default_lock:
        if _default_gpu is None:
            _default_gpu = detect_gpu()
        return _default_gpu
