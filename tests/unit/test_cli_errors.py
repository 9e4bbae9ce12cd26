"""Every bad input to the ``speccycle`` command is one line on stderr, ``speccycle: error: ...``, naming the
problem, and exit code 2; Ctrl-C exits 130 with the finished prompts printed and written. The command runs
in-process (`cli.main`); the cases that need a model share one engine of the embedded SmolLM2."""

from __future__ import annotations

import json

import pytest
import torch
from speccycle import cli
from speccycle.cli import main
from speccycle.core import SpecConfig
from speccycle.engine import bench as bench_module


def run(argv: list[str], capsys) -> tuple[int, str, str]:
    code = main(argv)
    out, err = capsys.readouterr()
    return code, out, err


def one_line_error(code: int, err: str, *needles: str) -> str:
    """The error line; asserts exit 2, one line, no traceback, and every needle in it."""
    assert code == 2, err
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    line = lines[0]
    assert line.startswith("speccycle: error: "), line
    for needle in needles:
        assert needle in line, line
    return line


@pytest.fixture
def no_model(monkeypatch):
    """Fails the test if the command gets as far as loading a model: these errors come before."""

    def refuse(*_):
        raise AssertionError("the command loaded a model before refusing its input")

    monkeypatch.setattr(cli, "_load_engine", refuse)


@pytest.fixture(scope="module")
def engine(model_path):
    from speccycle.engine.engine import Engine

    return Engine.load(None, draft="ngram", spec=SpecConfig(num_steps=4, page_size=16), kv_tokens=4096)


@pytest.fixture
def loaded(engine, monkeypatch):
    """`cli._load_engine` hands out the shared engine (its draft: ngram)."""
    monkeypatch.setattr(cli, "_load_engine", lambda args, spec: engine)
    return engine


def prompts_file(tmp_path, text: str | bytes, name: str = "prompts.jsonl") -> str:
    path = tmp_path / name
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    return str(path)


# ---- the model -------------------------------------------------------------------------------------


def test_a_missing_model_is_one_line(tmp_path, capsys):
    code, _, err = run(["generate", "hi", "--model", str(tmp_path / "nope.gguf")], capsys)
    one_line_error(code, err, "nope.gguf", "no such file or directory", ".gguf file")


def test_a_model_that_is_not_gguf_is_one_line_without_python_hints(tmp_path, capsys):
    text = tmp_path / "notes.gguf"
    text.write_text("hello, I am not a model")
    code, _, err = run(["generate", "hi", "--model", str(text), "--draft", "ngram"], capsys)
    line = one_line_error(code, err, "notes.gguf", "not a GGUF file")
    assert "load_hf" not in line and "weights_hf" not in line
    code, _, err = run(["generate", "hi", "--model", str(tmp_path), "--draft", "ngram"], capsys)
    one_line_error(code, err, "no config.json")


# ---- the prompts file ------------------------------------------------------------------------------


def test_an_unknown_category_names_the_ones_there(capsys, no_model):
    code, _, err = run(["bench", "--categories", "nosuchcat"], capsys)
    one_line_error(code, err, "'nosuchcat'", "writing", "coding")


@pytest.mark.parametrize(
    ("line", "needle"),
    [
        ('["a", "b"]', "a JSON list"),
        ("42", "a JSON number"),
        ('"text"', "a JSON string"),
        ("{not json", "not valid JSON"),
        ('{"category": "qa"}', "no 'turns'"),
        ('{"turns": "text"}', "'turns' is a JSON string"),
        ('{"turns": []}', "'turns' is an empty list"),
        ('{"turns": [3]}', "the first turn is a JSON number"),
        ('{"turns": [""]}', "the first turn is an empty string"),
        ('{"turns": ["hi"], "category": 7}', "'category'"),
    ],
)
def test_a_bad_prompts_line_names_the_file_and_line(tmp_path, capsys, no_model, line, needle):
    path = prompts_file(tmp_path, '{"category": "qa", "turns": ["What is a KV cache?"]}\n\n' + line + "\n")
    code, _, err = run(["bench", "--prompts", path], capsys)
    one_line_error(code, err, f"{path} line 3", needle)


def test_turns_as_a_string_is_refused_by_load_prompts_not_read_as_its_first_letter(tmp_path):
    path = prompts_file(tmp_path, '{"turns": "Write a poem"}\n')
    with pytest.raises(ValueError, match="line 1: 'turns' is a JSON string"):
        bench_module.load_prompts(path)


def test_a_prompts_file_that_is_not_utf8_is_named(tmp_path, capsys, no_model):
    path = prompts_file(tmp_path, b'{"turns": ["caf' + b"\xe9" + b'"]}\n', "latin1.jsonl")
    code, _, err = run(["bench", "--prompts", path], capsys)
    one_line_error(code, err, path, "not UTF-8", "line 1")


def test_a_missing_or_empty_prompts_file_is_one_line(tmp_path, capsys, no_model):
    code, _, err = run(["bench", "--prompts", str(tmp_path / "none.jsonl")], capsys)
    one_line_error(code, err, "no prompts file at", "none.jsonl")
    code, _, err = run(["bench", "--prompts", prompts_file(tmp_path, "\n\n")], capsys)
    one_line_error(code, err, "holds no prompts")


@pytest.mark.parametrize("limit", ["-1", "0", "two"])
def test_a_limit_below_one_or_not_a_number_is_refused(capsys, no_model, limit):
    code, _, err = run(["bench", "--limit", limit], capsys)
    one_line_error(code, err, "--limit", limit)


# ---- options -----------------------------------------------------------------------------------------


def test_cuda_on_a_torch_without_cuda_is_one_line(capsys, monkeypatch, no_model):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    code, _, err = run(["generate", "hi", "--device", "cuda"], capsys)
    one_line_error(code, err, "--device cuda", "use --device cpu")
    code, _, err = run(["generate", "hi", "--device", "tpu"], capsys)
    one_line_error(code, err, "--device 'tpu'")


@pytest.mark.parametrize(
    ("options", "spec"),
    [
        (["--topk", "2", "--draft-tokens", "50"], dict(num_steps=4, topk=2, num_draft_tokens=50)),
        (["--steps", "2", "--topk", "2", "--draft-tokens", "1"], dict(num_steps=2, topk=2, num_draft_tokens=1)),
        (["--steps", "4", "--topk", "1", "--draft-tokens", "8"], dict(num_steps=4, topk=1, num_draft_tokens=8)),
        (["--steps", "-1"], dict(num_steps=-1, topk=1)),
        (["--topk", "17"], dict(num_steps=4, topk=17)),
        (["--page-size", "0", "--steps", "3"], dict(num_steps=3, page_size=0)),
    ],
)
def test_a_config_spec_config_refuses_is_refused_with_its_message(capsys, no_model, options, spec):
    with pytest.raises(ValueError) as refused:
        SpecConfig(**spec)
    code, _, err = run(["generate", "hi", "--draft", "ngram", *options], capsys)
    line = one_line_error(code, err)
    assert line == f"speccycle: error: {refused.value}"


def test_a_draft_floor_without_a_forward_drafts_chain_is_refused_with_what_to_do(capsys, no_model):
    code, _, err = run(["generate", "hi", "--draft", "eagle", "--topk", "2", "--draft-floor", "0.2"], capsys)
    one_line_error(code, err, "draft_floor=0.2", "needs topk (K)=1", "--topk 1")
    code, _, err = run(["generate", "hi", "--draft", "eagle", "--draft-floor", "0.2"], capsys)  # a tree by default
    one_line_error(code, err, "needs topk (K)=1", "--topk 1")
    code, _, err = run(["generate", "hi", "--draft", "ngram", "--draft-floor", "0.2"], capsys)
    one_line_error(code, err, "--draft-floor", "--draft ngram", "drop --draft-floor")
    code, _, err = run(["generate", "hi", "--draft", "eagle", "--topk", "1", "--draft-floor", "1.5"], capsys)
    one_line_error(code, err, "draft_floor must be a number in [0, 1), got 1.5")


def test_bad_sampling_and_draft_options_are_refused_before_loading(tmp_path, capsys, no_model):
    code, _, err = run(["generate", "hi", "--top-p", "2"], capsys)
    one_line_error(code, err, "top_p=2.0")
    code, _, err = run(["generate", "hi", "--draft", "model"], capsys)
    one_line_error(code, err, "--draft-model")
    code, _, err = run(["generate", "hi", "--eagle-head", str(tmp_path / "head.safetensors")], capsys)
    one_line_error(code, err, "--eagle-head", "head.safetensors")
    code, _, err = run(["generate", "hi", "--draft", "none", "--temperature", "0.7"], capsys)
    one_line_error(code, err, "--draft none")
    code, _, err = run(["bench", "--temperature", "0.7"], capsys)
    one_line_error(code, err, "--temperature 0")
    code, _, err = run(["generate", "hi", "--max-new-tokens", "0"], capsys)
    one_line_error(code, err, "--max-new-tokens")
    code, _, err = run(["demo", "--agreement", "1.5"], capsys)
    one_line_error(code, err, "--agreement", "[0, 1]")
    code, _, err = run(["nosuchcommand"], capsys)
    one_line_error(code, err, "nosuchcommand")


def test_bad_sampling_parameters_are_refused_before_loading(capsys, no_model):
    code, _, err = run(["generate", "hi", "--min-p", "1.5"], capsys)
    one_line_error(code, err, "min_p=1.5")
    code, _, err = run(["generate", "hi", "--repetition-penalty", "0"], capsys)
    one_line_error(code, err, "repetition_penalty=0.0")
    code, _, err = run(["generate", "hi", "--logit-bias", "42"], capsys)
    one_line_error(code, err, "--logit-bias", "TOKEN=BIAS")
    code, _, err = run(["generate", "hi", "--bad-words", "1,x"], capsys)
    one_line_error(code, err, "--bad-words", "token ids")
    code, _, err = run(["generate", "hi", "--top-logprobs", "99"], capsys)
    one_line_error(code, err, "top_logprobs=99")
    code, _, err = run(["generate", "hi", "--draft", "none", "--no-speculate"], capsys)
    one_line_error(code, err, "--draft none", "--no-speculate")
    code, _, err = run(["bench", "--frequency-penalty", "0.5"], capsys)
    one_line_error(code, err, "plain greedy")


def test_an_empty_prompt_is_refused(capsys, no_model):
    for argv in (["generate", "--raw", ""], ["generate", ""], ["generate", "  ", "--raw"]):
        code, out, err = run(argv, capsys)
        one_line_error(code, err, "the prompt is empty")
        assert out == ""


# ---- the --json path -----------------------------------------------------------------------------


@pytest.mark.parametrize("where", ["missing folder", "a folder", "under a file"])
def test_an_unwritable_json_path_is_refused_before_the_run(tmp_path, capsys, no_model, where):
    (tmp_path / "notes.txt").write_text("a file")
    path = {
        "missing folder": tmp_path / "no" / "such" / "out.json",
        "a folder": tmp_path,
        "under a file": tmp_path / "notes.txt" / "out.json",
    }[where]
    code, _, err = run(["bench", "--json", str(path)], capsys)
    one_line_error(code, err, "--json", str(path))


# ---- the model's context (needs the model) -------------------------------------------------------


def test_a_prompt_past_the_context_is_refused_before_the_run(loaded, tmp_path, capsys, monkeypatch):
    def refuse(*_, **__):
        raise AssertionError("decoding started")

    monkeypatch.setattr(loaded, "generate", refuse)
    monkeypatch.setattr(loaded, "generate_autoregressive", refuse)
    limit = loaded.model.config.max_position
    code, out, err = run(["generate", "hi", "--draft", "ngram", "--max-new-tokens", str(limit)], capsys)
    one_line_error(code, err, f"context of {limit} tokens", "--max-new-tokens")
    assert out == ""
    path = prompts_file(tmp_path, '{"turns": ["short"]}\n{"turns": ["' + "KV cache " * limit + '"]}\n')
    code, _, err = run(["bench", "--prompts", path, "--draft", "ngram", "--max-new-tokens", "4", "--quiet"], capsys)
    one_line_error(code, err, f"{path} line 2", f"context of {limit} tokens")


# ---- bench: order, warm-up, Ctrl-C ------------------------------------------------------------------


def _calls(engine, monkeypatch, interrupt_at: int | None = None) -> list[str]:
    """Record each decode call of the bench ('ar' or 'spec'; not the ones inside them: `generate` without a
    draft decodes autoregressively); raise KeyboardInterrupt at call number ``interrupt_at``."""
    calls: list[str] = []
    depth = [0]
    generate, autoregressive = engine.generate, engine.generate_autoregressive

    def wrap(name, fn):
        def call(*args, **kwargs):
            if depth[0] == 0:
                calls.append(name)
                if interrupt_at is not None and len(calls) == interrupt_at:
                    raise KeyboardInterrupt
            depth[0] += 1
            try:
                return fn(*args, **kwargs)
            finally:
                depth[0] -= 1

        return call

    monkeypatch.setattr(engine, "generate", wrap("spec", generate))
    monkeypatch.setattr(engine, "generate_autoregressive", wrap("ar", autoregressive))
    return calls


def test_ctrl_c_prints_and_writes_what_finished_and_exits_130(loaded, tmp_path, capsys, monkeypatch):
    path = prompts_file(
        tmp_path,
        '{"category": "qa", "turns": ["What is a KV cache?"]}\n{"category": "writing", "turns": ["A haiku on KV."]}\n',
    )
    out_json = tmp_path / "bench.json"
    calls = _calls(loaded, monkeypatch, interrupt_at=5)  # warm-up ar, spec; prompt 1 ar, spec; prompt 2 spec
    argv = ["bench", "--prompts", path, "--draft", "ngram", "--max-new-tokens", "4", "--quiet", "--json", str(out_json)]
    code, out, err = run(argv, capsys)
    assert code == 130, err
    assert calls == ["ar", "spec", "ar", "spec", "spec"]  # warmed; the 2nd prompt runs speculative first
    assert "interrupted: 1 of 2 prompts finished" in out and "qa" in out and "writing" not in out
    assert "Traceback" not in err and "interrupted" in err
    record = json.loads(out_json.read_text())
    assert record["interrupted"] is True and record["prompts"] == 1 and record["prompt_count"] == 2
    assert list(record["categories"]) == ["qa"] and record["new_tokens"] == 4 and record["identical_to_ar"] == 1


def test_ctrl_c_while_generating_exits_130(loaded, capsys, monkeypatch):
    _calls(loaded, monkeypatch, interrupt_at=1)
    code, _, err = run(["generate", "hi", "--draft", "ngram", "--max-new-tokens", "4"], capsys)
    assert code == 130 and "Traceback" not in err and "interrupted" in err


def test_bench_reports_what_ran_and_draft_none_has_no_tau(loaded, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(loaded, "draft", None)  # the engine `--draft none` loads
    calls = _calls(loaded, monkeypatch)
    out_json = tmp_path / "none.json"
    argv = ["bench", "--draft", "none", "--limit", "3", "--max-new-tokens", "4", "--quiet", "--json", str(out_json)]
    code, out, err = run(argv, capsys)
    assert code == 0, err
    assert calls == ["ar", "spec", "ar", "spec", "spec", "ar", "ar", "spec"]
    header, headline, *rest = out.splitlines()
    assert "SmolLM2-135M-Instruct.Q4_1.gguf" in header and "draft none" in header and "float32" in header
    assert "4 new tokens a prompt, 3 prompts" in header and "cpu" in header
    assert headline.startswith("autoregressive ") and "speculative " in headline and "x (whole run" in headline
    all_row = next(line for line in rest if line.startswith("all "))
    assert all_row.split()[5] == "-"  # tau
    assert any(line.startswith("identical:") and "tau:" in line for line in rest)
    record = json.loads(out_json.read_text())
    for key in ("model", "draft", "device", "config", "prompts_file", "new_tokens", "prompts", "ar_tokens_per_s"):
        assert key in record
    for key in ("spec_tokens_per_s", "speedup", "identical_to_ar", "accept_len_histogram", "categories", "commit"):
        assert key in record
    assert record["tau"] is None and record["identical_to_ar"] == 3 and record["max_new_tokens"] == 4
    assert record["header"] == header and record["interrupted"] is False
    assert record["speedup"] == pytest.approx(record["spec_tokens_per_s"] / record["ar_tokens_per_s"], rel=0.01)


# ---- grammars ------------------------------------------------------------------------------------


def test_a_json_schema_that_is_not_json_is_one_line_before_the_model_loads(capsys, no_model):
    code, _, err = run(["generate", "hi", "--json-schema", "{not json"], capsys)
    one_line_error(code, err, "--json-schema", "neither a file nor JSON text")


def test_two_grammars_at_once_are_refused_by_the_parser(capsys, no_model):
    code, _, err = run(["generate", "hi", "--regex", "a+", "--grammar", "start: x"], capsys)
    one_line_error(code, err, "--grammar: not allowed with argument --regex")


def test_a_grammar_that_does_not_compile_is_one_line(capsys, loaded):
    pytest.importorskip("llguidance")
    code, _, err = run(["generate", "hi", "--grammar", "start: undefined_rule", "--max-new-tokens", "4"], capsys)
    one_line_error(code, err, "the grammar does not compile", "undefined_rule")


def test_bench_refuses_a_grammar(capsys, no_model):
    code, _, err = run(["bench", "--regex", "a+"], capsys)
    one_line_error(code, err, "constrain `speccycle generate`", "bench/constrained.py")
