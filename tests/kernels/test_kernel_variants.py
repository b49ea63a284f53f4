"""Which build of the native kernels serves: chosen at run time from the CPU's flags."""

from __future__ import annotations

import pytest

from chatstore.kernels import native

AVX2_ONLY = native._V3 | {"sse4_2"}  # an AMD EPYC of the AVX2-only kind, as /proc/cpuinfo says
AVX512_NO_BF16 = native._V4


@pytest.fixture
def cpu(monkeypatch):
    def pretend(flags: frozenset[str]) -> None:
        monkeypatch.setattr(native, "cpu_flags", lambda: frozenset(flags))
        monkeypatch.setattr(native, "_is_x86", lambda: True)

    monkeypatch.delenv("CHATSTORE_KERNEL_ISA", raising=False)
    monkeypatch.delenv("CHATSTORE_BF16_DOT", raising=False)
    return pretend


@pytest.mark.parametrize(
    ("flags", "chosen"),
    [
        (AVX512_NO_BF16 | {"avx512_bf16", "amx_bf16"}, "avx512_bf16"),
        (AVX512_NO_BF16, "avx512"),
        (AVX2_ONLY, "avx2"),
        (frozenset({"sse2"}), "generic"),
    ],
)
def test_the_best_variant_the_cpu_reports_serves(cpu, flags, chosen):
    cpu(flags)
    assert native.selected_variant().name == chosen
    assert native.runnable_variants()[0].name == chosen


def test_an_avx2_cpu_never_gets_avx512_instructions(cpu):
    cpu(AVX2_ONLY)
    assert [v.name for v in native.runnable_variants()] == ["avx2", "generic"]
    for v in native.runnable_variants():
        assert not any("avx512" in flag for flag in v.cflags), v


def test_a_pinned_variant_serves(cpu, monkeypatch):
    cpu(AVX512_NO_BF16 | {"avx512_bf16"})
    monkeypatch.setenv("CHATSTORE_KERNEL_ISA", "avx2")
    assert native.selected_variant().name == "avx2"


def test_bf16_dot_off_takes_the_best_variant_without_it(cpu, monkeypatch):
    cpu(AVX512_NO_BF16 | {"avx512_bf16"})
    monkeypatch.setenv("CHATSTORE_BF16_DOT", "0")
    assert native.selected_variant().name == "avx512"


def test_a_variant_this_cpu_cannot_run_is_a_clear_error(cpu, monkeypatch):
    cpu(AVX2_ONLY)
    monkeypatch.setenv("CHATSTORE_KERNEL_ISA", "avx512")
    with pytest.raises(ValueError, match=r"cannot run the avx512 kernels: it lacks \['avx512bw'"):
        native.selected_variant()
    monkeypatch.setenv("CHATSTORE_KERNEL_ISA", "avx1024")
    with pytest.raises(ValueError, match="unknown kernel ISA 'avx1024': one of"):
        native.selected_variant()


def test_hidden_flags_are_taken_away_never_added():
    """CHATSTORE_HIDE_CPU_FLAGS (make test-avx2) removes what its patterns match, and nothing
    else: an AVX512-BF16 machine then reports what an AVX2-only one does."""
    zen5 = AVX512_NO_BF16 | {"avx512_bf16", "avx512_vnni", "avx_vnni", "sse4_2"}
    hidden = native.hide_flags(zen5, "avx512*, amx*,avx_vnni*,avx_ne_convert*")
    assert hidden == AVX2_ONLY
    assert native.hide_flags(zen5, "") == zen5
    assert native.hide_flags(zen5, "amx*,nonesuch") == zen5  # a pattern matching nothing


def test_hidden_flags_apply_to_what_the_os_reports(monkeypatch):
    reported = "flags\t: " + " ".join(sorted(AVX512_NO_BF16 | {"sse4_2"}))
    monkeypatch.setattr(native, "_cpuinfo", lambda: reported)
    monkeypatch.setenv("CHATSTORE_HIDE_CPU_FLAGS", "avx512*")
    native.cpu_flags.cache_clear()
    try:
        assert native.cpu_flags() == AVX2_ONLY
    finally:
        native.cpu_flags.cache_clear()


def test_every_runnable_variant_builds_and_says_what_it_is():
    """The variants this CPU runs are the ones `make test` exercises (tests/kernels/conftest.py):
    each builds, and its vector width and bf16 path are those of its ISA."""
    widths = {"avx512_bf16": 512, "avx512": 512, "avx2": 256, "generic": 128}
    for v in native.runnable_variants():
        lib = native.variant_library(v.name)
        if lib is None:
            pytest.skip("no compiler here")
        features = native.kernel_features(lib)
        assert features.bf16_dot == (v.name == "avx512_bf16"), v.name
        if v.name in widths:
            assert features.vector_bits == widths[v.name], v.name


def test_bf16_asked_for_where_it_is_emulated_is_said_at_start(monkeypatch):
    import torch

    from chatstore.engine import cpu_paths

    monkeypatch.setattr(cpu_paths, "cpu_has_fast_bf16", lambda: False)
    assert cpu_paths.cpu_path_warnings(torch.bfloat16) == [cpu_paths.EMULATED_BF16]
    assert cpu_paths.cpu_path_warnings(torch.float32) == []
    monkeypatch.setattr(cpu_paths, "cpu_has_fast_bf16", lambda: True)
    assert cpu_paths.cpu_path_warnings(torch.bfloat16) == []
