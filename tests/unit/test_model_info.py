"""Issues 26 and 43: the served model's names, `hybridgate info`, a model without a chat template, and the
refusals at start-up (one line naming what is refused, exit 2, no worker started)."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import gguf
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from malformed_gguf import FAULTS, write_malformed
from tiny_gguf import write_tiny_llama

from hybridgate.cli import main
from hybridgate.models import ChatTemplate, Tokenizer, load_gguf, model_name, model_names, served_name
from hybridgate.models.info import describe
from hybridgate.router import Router
from hybridgate.router.router import RouterConfig
from hybridgate.run.serve import served_names
from hybridgate.run.config import MODEL_NAME
from hybridgate.wire import InvalidFieldError

CHAT = [{"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return tmp_path_factory.mktemp("models")


@pytest.fixture(scope="module")
def base(folder):
    """A tiny Llama base model: no general.name, no chat template; head_dim 16 (both runners)."""
    return write_tiny_llama(folder / "tiny-base.gguf", heads=4, kv_heads=2, head_dim=16)


@pytest.fixture(scope="module")
def malformed(folder):
    return {fault: write_malformed(folder / f"{fault}.gguf", fault) for fault in FAULTS}


def info_lines(capsys, path) -> tuple[int, dict[str, list[str]]]:
    code = main(["info", "--model", str(path)])
    lines: dict[str, list[str]] = {}
    for line in capsys.readouterr().out.splitlines():
        label, _, value = line.partition(":")
        lines.setdefault(label, []).append(value.strip())
    return code, lines


def test_served_name_is_the_file_stem_and_general_name_an_alias(model_path, gguf_model, base):
    reference = gguf.GGUFReader(model_path).fields["general.name"].contents().strip()
    assert " " in reference  # the old default name, which a shell and a URL need quoted
    assert model_name(gguf_model) == "SmolLM2-135M-Instruct.Q4_1" == model_path.name.removesuffix(".gguf")
    assert model_names(gguf_model) == ("SmolLM2-135M-Instruct.Q4_1", reference)
    assert "general.name" not in gguf.GGUFReader(base).fields
    assert model_names(load_gguf(base)) == ("tiny-base",)


@pytest.mark.parametrize("file, name", [
    ("SmolLM2-135M-Instruct.Q4_1.gguf", "SmolLM2-135M-Instruct.Q4_1"),  # case kept, only .gguf goes
    ("gemma-3-270m-it-Q8_0.gguf", "gemma-3-270m-it-Q8_0"),
    ("My Model (v2).gguf", "My-Model-v2"),
    ("  two   spaces\t.gguf", "two-spaces"),
    (".hidden_model.gguf", "hidden_model"),
    ("modèle.gguf", "mod-le"),
    ("(((.gguf", "model"),
    ("x" * 200 + ".gguf", "x" * 128),
])
def test_served_name_rules(file, name):
    assert served_name(Path("/some folder") / file) == name


@settings(max_examples=200, deadline=None)
@given(st.text(min_size=1, max_size=200).filter(lambda s: "/" not in s and "\x00" not in s))
def test_served_name_has_no_space_and_is_a_name_the_flags_accept(stem):
    name = served_name(Path(f"{stem}.gguf"))
    assert not any(c.isspace() for c in name) and MODEL_NAME.fullmatch(name), name


def test_the_operator_names_win_over_the_model_own(gguf_model):
    own = model_names(gguf_model)
    assert served_names("", (), gguf_model) == own  # nothing named: the file's stem, general.name as alias
    assert served_names("smol", (), gguf_model) == ("smol",)  # a fleet's NAME=PATH: NAME only
    assert served_names("", ("chat", "alias"), gguf_model) == ("chat", "alias")  # --served-model-name
    assert served_names("smol", ("chat", "smol"), gguf_model) == ("smol", "chat")


def test_info_counts_tensors_and_parameters_as_gguf_reads_them(capsys, base):
    reader = gguf.GGUFReader(base)
    mix = Counter(t.tensor_type.name for t in reader.tensors)
    params = sum(int(t.n_elements) for t in reader.tensors)
    code, lines = info_lines(capsys, base)
    assert code == 0
    assert lines["name"] == ["tiny-base"] and lines["architecture"] == ["llama"]
    assert lines["parameters"][0].startswith(f"{params:,} ")
    assert lines["quant mix"] == [", ".join(f"{k} {v}" for k, v in mix.most_common())]
    assert lines["tokenizer"][0].startswith("gpt2 (byte-level BPE), pre-tokenizer smollm, 260 tokens")
    assert "--chat-template" in lines["chat template"][0]
    assert lines["context"] == [str(reader.fields["llama.context_length"].contents())]
    assert lines["runner gpu"] == ["PyTorch runner: yes"] and lines["runner cpu"] == ["Numba runner: yes"]


def test_info_says_which_runner_refuses_and_why(capsys, folder):
    narrow = write_tiny_llama(folder / "narrow.gguf", heads=4, kv_heads=2, head_dim=8)
    code, lines = info_lines(capsys, narrow)
    assert code == 0  # the torch runner serves it
    assert lines["runner gpu"] == ["PyTorch runner: yes"]
    assert lines["runner cpu"][0].startswith("Numba runner: no:") and "head_dim 8" in lines["runner cpu"][0]


@pytest.mark.parametrize("fault", FAULTS)
def test_info_prints_the_refusal_and_what_it_could_read(capsys, malformed, fault):
    code, lines = info_lines(capsys, malformed[fault])
    assert code == 2
    assert len(lines["refused"]) == 1 and FAULTS[fault] in lines["refused"][0]
    reader = gguf.GGUFReader(malformed[fault])
    assert lines["parameters"][0].startswith(f"{sum(int(t.n_elements) for t in reader.tensors):,} ")


@pytest.mark.parametrize("fault", FAULTS)
def test_serve_refuses_at_start_up_in_one_line_before_any_worker(capsys, monkeypatch, malformed, fault):
    started = []
    monkeypatch.setattr("hybridgate.run.supervise.Supervisor._start", lambda self, slot: started.append(slot.name))
    code = main(["serve", "--model", str(malformed[fault]), "--gpu-workers", "1", "--cpu-workers", "1",
                 "--port", "0"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and started == []
    assert len(err) == 1 and err[0].startswith("hybridgate serve: error: ") and FAULTS[fault] in err[0]


def test_describe_names_the_refused_part_only(malformed):
    for fault, path in malformed.items():
        report = describe(path)
        refusals = [r for r in (report.model_refusal, report.tokenizer_refusal) if r]
        assert len(refusals) == 1 and FAULTS[fault] in refusals[0], (fault, refusals)
        assert (report.model is None) == (fault in ("architecture", "tensor_type", "missing_tensor"))


def test_a_model_without_template_serves_completions_and_chats_only_with_one(tmp_path, base):
    model = load_gguf(base)
    router = Router(model, [], RouterConfig())
    assert not router.chat_template.present
    assert router.tokenize("Hi") == Tokenizer.from_model(model).encode("Hi")
    with pytest.raises(InvalidFieldError, match="--chat-template") as refused:
        router.tokenize(CHAT)
    assert refused.value.field == "messages"
    template = tmp_path / "plain.jinja"
    template.write_text("{{ bos_token }}{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}")
    ids = Router(model, [], RouterConfig(chat_template=str(template))).tokenize(CHAT)
    assert Tokenizer.from_model(model).decode(ids) == "<|im_start|>user: Hi\n"


def test_template_gets_every_special_token_the_file_names(base, folder):
    """unk/pad tokens come from their GGUF keys (transformers passes its special_tokens_map)."""
    reader = gguf.GGUFReader(base)
    tokens = reader.fields["tokenizer.ggml.tokens"].contents()
    meta = {k: f.contents() for k, f in reader.fields.items()}
    meta |= {"tokenizer.ggml.unknown_token_id": 0, "tokenizer.ggml.padding_token_id": 2}
    from hybridgate.models.chat import template_token_ids

    chat = ChatTemplate(Tokenizer(meta), "{{ bos_token }}|{{ eos_token }}|{{ unk_token }}|{{ pad_token }}",
                        template_token_ids(meta))
    assert chat.render(CHAT) == "|".join(tokens[i] for i in (1, 2, 0, 2))


def test_runner_verdicts_are_kept_per_model_code_and_packages(base, tmp_path, monkeypatch):
    """The second `info` of a file takes the runners' verdicts from the cache (no torch import, no repacking);
    another version of a runner's package checks again."""
    from hybridgate.models import model_fingerprint
    from hybridgate.workers import support

    monkeypatch.setenv("HYBRIDGATE_CACHE_DIR", str(tmp_path))
    model = load_gguf(base)
    fingerprint = model_fingerprint(model)
    first = support.runner_verdicts(model, fingerprint)
    assert [(r.kind, refusal) for r, refusal in first] == [("gpu", ""), ("cpu", "")]  # head_dim 16: both build
    assert len(list((tmp_path / "runners").glob("*.json"))) == 1

    def refuse(runner, model):
        return f"checked again ({runner.kind})"

    monkeypatch.setattr(support, "runner_refusal", refuse)
    assert support.runner_verdicts(model, fingerprint) == first
    monkeypatch.setattr(support, "version", lambda name: "99.0" if name == "numba" else "1.0")
    assert [refusal for _, refusal in support.runner_verdicts(model, fingerprint)] == \
        ["checked again (gpu)", "checked again (cpu)"]


def test_runner_checks_run_side_by_side_and_their_answers_cross_intact(base, tmp_path, monkeypatch):
    """The first check of a file runs the gpu runner's in a forked child beside the cpu runner's here; each
    verdict reaches the caller as the check wrote it, and a child's unexpected error is raised by name."""
    import os

    from hybridgate.models import model_fingerprint
    from hybridgate.workers import support

    monkeypatch.setenv("HYBRIDGATE_CACHE_DIR", str(tmp_path))
    model = load_gguf(base)
    here = os.getpid()
    monkeypatch.setattr(support, "runner_refusal", lambda runner, model: f"{runner.kind} in {os.getpid()}: ü ✓")
    (gpu, in_gpu), (cpu, in_cpu) = support.runner_verdicts(model, model_fingerprint(model))
    assert (gpu.kind, cpu.kind) == ("gpu", "cpu") and in_cpu == f"cpu in {here}: ü ✓"
    assert in_gpu.startswith("gpu in ") and in_gpu.endswith(": ü ✓") and in_gpu != f"gpu in {here}: ü ✓"

    def fails():
        raise MemoryError("out of memory building the weights")

    with pytest.raises(RuntimeError, match="MemoryError: out of memory building the weights"):
        support.side_by_side([fails, lambda: "fine"])
    assert support.side_by_side([lambda: "a", lambda: "b", lambda: "c"]) == ["a", "b", "c"]


def test_info_names_an_embedding_models_pooling_and_nothing_for_a_generation_model(base):
    import dataclasses

    from hybridgate.models.info import describe, report_lines

    report = describe(base)
    assert "pooling" not in dict(report_lines(report))  # pooling_type 0: a generation model
    for number, name in ((1, "mean"), (2, "cls"), (3, "last")):  # llama.cpp's llama_pooling_type numbers
        config = dataclasses.replace(report.model.config, pooling_type=number)
        pooled = dataclasses.replace(report, model=dataclasses.replace(report.model, config=config))
        line = dict(report_lines(pooled))["pooling"]
        assert line.startswith(f"{name} (pooling_type {number})") and "/v1/embeddings" in line
