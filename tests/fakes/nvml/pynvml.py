"""A test double of nvidia-ml-py's ``pynvml`` for machines without an NVIDIA GPU (the CI machine).

Only the names sparkguard.gpumem calls, with nvidia-ml-py 13.615's signatures, error codes and
error classes (``NVMLError(value)`` maps to its subclass, e.g. ``NVMLError_NotSupported``).  The
devices and their compute processes come from ``STATE`` (in-process tests) or, when
``SG_FAKE_NVML`` names a JSON file, from that file, re-read at each call (a daemon started by a
test; the test rewrites the file to change what NVML reports)::

    {"init_error": null | "LIBRARY_NOT_FOUND" | "DRIVER_NOT_LOADED" | ...,
     "devices": [{"procs": [{"pid": 1234, "used": 2147483648}], "error": null | "NOT_SUPPORTED" | ...}]}

``used`` null stands for NVML_VALUE_NOT_AVAILABLE (pynvml turns it into ``usedGpuMemory None``).
``nvmlDeviceGetMemoryInfo`` raises NOT_SUPPORTED, as on a GB10.  Put ``tests/fakes/nvml`` first on
PYTHONPATH to make ``import pynvml`` load this.
"""

from __future__ import annotations

import json
import os
import types

# error codes as in pynvml.py (NVML_ERROR_*)
NVML_SUCCESS = 0
NVML_ERROR_UNINITIALIZED = 1
NVML_ERROR_INVALID_ARGUMENT = 2
NVML_ERROR_NOT_SUPPORTED = 3
NVML_ERROR_NO_PERMISSION = 4
NVML_ERROR_NOT_FOUND = 6
NVML_ERROR_INSUFFICIENT_SIZE = 7
NVML_ERROR_DRIVER_NOT_LOADED = 9
NVML_ERROR_LIBRARY_NOT_FOUND = 12
NVML_ERROR_GPU_IS_LOST = 15
NVML_ERROR_UNKNOWN = 999

STATE: dict = {"devices": []}
CALLS: list[str] = []
_initialised = 0


class NVMLError(Exception):
    """As pynvml's: ``NVMLError(code)`` is an instance of the code's subclass; ``.value`` the code."""

    _valClassMapping: dict = {}
    _errcode_to_string = {
        NVML_ERROR_UNINITIALIZED: "Uninitialized", NVML_ERROR_INVALID_ARGUMENT: "Invalid Argument",
        NVML_ERROR_NOT_SUPPORTED: "Not Supported", NVML_ERROR_NO_PERMISSION: "Insufficient Permissions",
        NVML_ERROR_NOT_FOUND: "Not Found", NVML_ERROR_INSUFFICIENT_SIZE: "Insufficient Size",
        NVML_ERROR_DRIVER_NOT_LOADED: "Driver Not Loaded",
        NVML_ERROR_LIBRARY_NOT_FOUND: "NVML Shared Library Not Found", NVML_ERROR_GPU_IS_LOST: "GPU is lost",
        NVML_ERROR_UNKNOWN: "Unknown Error",
    }

    def __new__(cls, value):
        if cls is NVMLError:
            cls = NVMLError._valClassMapping.get(value, cls)
        obj = Exception.__new__(cls)
        obj.value = value
        return obj

    def __str__(self):
        return self._errcode_to_string.get(self.value, f"NVML Error with code {self.value}")


def _subclasses() -> None:
    for name, code in list(globals().items()):
        if name.startswith("NVML_ERROR_"):
            cls_name = "NVMLError_" + "".join(w.capitalize() for w in name[len("NVML_ERROR_"):].split("_"))
            cls = type(cls_name, (NVMLError,), {"__new__": (lambda c: lambda typ, *a: NVMLError.__new__(typ, c))(code)})
            globals()[cls_name] = cls
            NVMLError._valClassMapping[code] = cls


_subclasses()


def _state() -> dict:
    path = os.environ.get("SG_FAKE_NVML")
    if path:
        with open(path) as f:
            return json.load(f)
    return STATE


def _raise(name: str | None) -> None:
    if name:
        raise NVMLError(globals()["NVML_ERROR_" + name])


def nvmlInit():
    global _initialised
    CALLS.append("nvmlInit")
    _raise(_state().get("init_error"))
    _initialised += 1


def nvmlShutdown():
    global _initialised
    CALLS.append("nvmlShutdown")
    if not _initialised:
        raise NVMLError(NVML_ERROR_UNINITIALIZED)
    _initialised -= 1


def _check_init() -> None:
    if not _initialised:
        raise NVMLError(NVML_ERROR_UNINITIALIZED)


def nvmlDeviceGetCount():
    _check_init()
    return len(_state().get("devices", []))


def nvmlDeviceGetHandleByIndex(index):
    _check_init()
    if not 0 <= index < len(_state().get("devices", [])):
        raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
    return types.SimpleNamespace(index=index)


def nvmlDeviceGetComputeRunningProcesses(handle):
    _check_init()
    CALLS.append(f"nvmlDeviceGetComputeRunningProcesses({handle.index})")
    dev = _state()["devices"][handle.index]
    _raise(dev.get("error"))
    return [types.SimpleNamespace(pid=p["pid"], usedGpuMemory=p.get("used"), gpuInstanceId=0xFFFFFFFF,
                                  computeInstanceId=0xFFFFFFFF) for p in dev.get("procs", [])]


def nvmlDeviceGetMemoryInfo(handle, version=None):
    _check_init()
    raise NVMLError(NVML_ERROR_NOT_SUPPORTED)      # as on a GB10 (FIELD-NOTES)
