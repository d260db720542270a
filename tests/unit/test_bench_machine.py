"""`bench.machine.describe`: what a bench JSON says it ran on, read from /proc/cpuinfo's text."""

from __future__ import annotations

from hybridgate.bench.machine import describe, summary

# Lines of /proc/cpuinfo as two VMs of this project's machines print them (flags cut to the ones that matter).
ZEN1 = """processor\t: 0
vendor_id\t: AuthenticAMD
cpu family\t: 23
model\t\t: 1
model name\t: AMD EPYC
flags\t\t: fpu sse2 avx f16c fma avx2 bmi2
processor\t: 1
cpu family\t: 23
model\t\t: 1
"""
XEON = """processor\t: 0
cpu family\t: 6
model\t\t: 207
model name\t: Intel(R) Xeon(R) Processor
flags\t\t: avx2 fma avx512f avx512bw avx512vl avx512_vnni avx512_bf16 amx_bf16 amx_tile amx_int8
"""


def test_family_and_model_name_the_microarchitecture_the_model_name_hides():
    zen1 = describe(ZEN1)
    assert (zen1["cpu_model"], zen1["cpu_family"], zen1["cpu_model_id"]) == ("AMD EPYC", 23, 1)
    assert (zen1["features"], zen1["isa"]) == (["avx2", "fma"], "avx2")
    assert "(AMD EPYC, family 23 model 1)" in summary(zen1)
    xeon = describe(XEON)
    assert (xeon["cpu_family"], xeon["cpu_model_id"], xeon["isa"]) == (6, 207, "avx512")
    assert xeon["features"] == ["avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16",
                                "amx_bf16"]


def test_a_cpuinfo_without_those_lines_leaves_them_empty():
    info = describe("processor\t: 0\n")
    assert (info["cpu_model"], info["cpu_family"], info["cpu_model_id"], info["isa"]) == ("", None, None, "other")
    assert "family" not in summary(info)
