"""Which vector instruction set the CPU kernels are compiled for, chosen once per process.

Three paths: `avx512` (AVX-512 F/BW/DQ/VL, VNNI when the CPU has it), `avx2`
(AVX2 with FMA and F16C) and `generic` (baseline x86-64 or the host's
baseline elsewhere: merely correct). `select()` picks the best path the host
reports (LLVM's host feature map), or the one forced by the `cpu_isa` setting
(`--cpu-isa`, `HYBRIDGATE_CPU_ISA`), and pins Numba's code generator to it by
setting `NUMBA_CPU_NAME` and `NUMBA_CPU_FEATURES` before Numba is imported:
LLVM targets the host otherwise, so the kernels' own `<16 x float>` IR would
still be lowered to AVX-512 registers on an AVX-512 machine. The path also
names the kernel cache folder (`NUMBA_CACHE_DIR`, one folder per path and
source digest), so a forced path compiles once and later starts load it.

On the avx512 path of a CPU with AMX-BF16 (Xeons since Sapphire Rapids) whose Linux grants the
tile state (`arch_prctl(ARCH_REQ_XCOMP_PERM)`), the target also carries `+amx-tile,+amx-bf16` for
the prompt matmuls of `amx` (`Target.amx`), unless the cpu_amx setting (`HYBRIDGATE_CPU_AMX`) is
"off"; those kernels compile into a cache folder of their own.

Sources: LLVM's X86 CPU definitions (X86.td) for the CPU names and feature
strings; Numba's `config.CPU_NAME` / `CPU_FEATURES` (numba/core/config.py).
"""

from __future__ import annotations

import hashlib
import os
import platform
import sys
from dataclasses import dataclass
from pathlib import Path

from hybridgate.config import environment

ISAS = ("avx512", "avx2", "generic")
ENV = "HYBRIDGATE_CPU_ISA"  # the cpu_isa setting's variable; read here only when no configuration chose
AMX_ENV = "HYBRIDGATE_CPU_AMX"  # the cpu_amx setting's variable ("auto" or "off"), the same way
_AMX = ("amx-tile", "amx-bf16", "avx512bf16")  # the last for vcvtne2ps2bf16, which every AMX CPU has
_ARCH_REQ_XCOMP_PERM, _XFEATURE_XTILEDATA, _SYS_ARCH_PRCTL = 0x1023, 18, 158

_AVX2 = ("avx", "avx2", "fma", "f16c", "bmi", "bmi2", "popcnt", "sse4.2", "lzcnt", "movbe")
_AVX512 = ("avx512f", "avx512bw", "avx512dq", "avx512vl", "avx512cd")
_NO_AVX512 = ("avx512f", "avx512bw", "avx512dq", "avx512vl", "avx512cd", "avx512vnni", "avx512bf16",
              "avx512ifma", "avx512vbmi", "avx512vbmi2", "avx512bitalg", "avx512vpopcntdq", "avx512fp16",
              "evex512", "avxvnni")


@dataclass(frozen=True)
class Target:
    """A path and how Numba's LLVM is told to compile for it."""

    isa: str  # one of ISAS
    cpu_name: str  # LLVM CPU name (NUMBA_CPU_NAME)
    features: str  # LLVM feature string (NUMBA_CPU_FEATURES): "+a,+b,-c"
    vnni: bool  # avx512 only: the CPU has AVX-512 VNNI
    cache_dir: str  # NUMBA_CACHE_DIR of this path
    amx: bool = False  # avx512 only: AMX-BF16 compiled in and granted (`amx`'s prompt matmuls run)


_selected: Target | None = None


def host_features() -> set[str]:
    """The vector features LLVM sees on this CPU (e.g. {"avx2", "fma", "avx512f", ...})."""
    import llvmlite.binding as ll  # llvmlite alone: Numba's configuration is not read yet

    try:
        return {name for name, on in ll.get_host_cpu_features().items() if on}
    except RuntimeError:  # LLVM cannot read the features on this platform
        return set()


def best(features: set[str]) -> str:
    """The fastest path a CPU with `features` runs."""
    if platform.machine().lower() in ("x86_64", "amd64"):
        if all(f in features for f in _AVX512):
            return "avx512"
        if all(f in features for f in ("avx2", "fma", "f16c")):
            return "avx2"
    return "generic"


def request_tiles() -> bool:
    """Ask Linux for the AMX tile state of this process (Documentation/arch/x86/xstate.rst): True when granted
    (or already held), False off Linux or when the kernel refuses. Needed before the first tile instruction."""
    import ctypes

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.syscall(_SYS_ARCH_PRCTL, _ARCH_REQ_XCOMP_PERM, _XFEATURE_XTILEDATA) == 0
    except (OSError, AttributeError):
        return False


def _target(isa: str, features: set[str], cache_root: Path, amx: bool = False) -> Target:
    digest = _sources_digest()
    cache = str(cache_root / f"{digest}-{isa}")
    if isa == "avx2":
        flags = [f"+{f}" for f in _AVX2] + [f"-{f}" for f in _NO_AVX512]
        return Target(isa, "haswell", ",".join(flags), False, cache)
    if isa == "avx512":
        vnni = "avx512vnni" in features
        flags = [f"+{f}" for f in _AVX2 + _AVX512] + ["+avx512vnni" if vnni else "-avx512vnni", "+evex512"]
        amx = amx and all(f in features for f in _AMX) and request_tiles()
        if amx:
            flags += [f"+{f}" for f in _AMX]
            cache += "-amx"
        return Target(isa, "skylake-avx512", ",".join(flags), vnni, cache, amx)
    return Target(isa, "generic", "", False, cache)


def _sources_digest() -> str:
    """A digest of this package's sources: Numba checks only the cached function's own file, not
    the intrinsics it calls from other files, so any change to them must start a fresh cache."""
    digest = hashlib.blake2b(digest_size=8)
    for path in sorted(Path(__file__).parent.glob("*.py")):
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


def select(forced: str | None = None, amx: str | None = None) -> Target:
    """Choose the path once for this process and point Numba at it; later calls return the same.

    forced: one of ISAS, or None/"" for the best the host runs (then `HYBRIDGATE_CPU_ISA` when a
    caller without a configuration, such as a test, set it). Raises ValueError for a name not in
    ISAS or a path this CPU cannot run, and RuntimeError when another path was already selected
    in this process (Numba compiles for one target per process). `NUMBA_CACHE_DIR` set by the
    user is kept; otherwise ~/.cache/hybridgate/numba/<digest>-<isa>[-amx].
    amx: "auto" (AMX-BF16 prompt matmuls where the avx512 path's CPU has them) or "off"; None or ""
    reads `HYBRIDGATE_CPU_AMX` (default auto). Raises ValueError for another value.
    """
    global _selected
    if not forced:
        forced = environment(ENV) or None
    amx = amx or environment(AMX_ENV) or "auto"
    if amx not in ("auto", "off"):
        raise ValueError(f"cpu_amx: expected auto or off, got {amx!r}")
    features = host_features()
    runnable = best(features)
    isa = forced or runnable
    if isa not in ISAS:
        raise ValueError(f"cpu_isa: expected one of {', '.join(ISAS)}, got {isa!r}")
    if ISAS.index(isa) < ISAS.index(runnable):  # before the check below: a new process would not help
        raise ValueError(f"cpu_isa: this CPU cannot run {isa} (it runs at most {runnable})")
    if _selected is not None:
        if forced and isa != _selected.isa:
            raise RuntimeError(f"cpu_isa: {_selected.isa} was already selected in this process; "
                               f"{isa} needs a new process")
        return _selected
    target = _target(isa, features, Path.home() / ".cache" / "hybridgate" / "numba", amx == "auto")
    os.environ["NUMBA_CPU_NAME"] = target.cpu_name
    os.environ["NUMBA_CPU_FEATURES"] = target.features
    os.environ.setdefault("NUMBA_CACHE_DIR", target.cache_dir)
    target = Target(target.isa, target.cpu_name, target.features, target.vnni, os.environ["NUMBA_CACHE_DIR"],
                    target.amx)
    if "numba.core.config" in sys.modules:
        _reload_numba_config()
    _selected = target
    return target


def _reload_numba_config() -> None:
    """Numba was imported before the path was chosen: re-read its configuration, which is only
    effective while its CPU target (and so LLVM's target machine) has not been built."""
    registry = sys.modules.get("numba.core.registry")
    if registry is not None and "_toplevel_target_context" in vars(registry.cpu_target):
        raise RuntimeError("cpu_isa: Numba already compiled for the host CPU in this process; select the "
                           "path before the first kernel is compiled or loaded")
    from numba.core import config

    config.reload_config()


def selected() -> Target:
    """The path of this process (selecting the default one if nothing did yet)."""
    return _selected if _selected is not None else select()
