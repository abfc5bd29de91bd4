"""Export: a run's models as PEFT adapter folders (and merged models) that plain
transformers + PEFT load and that generate what the run evaluated."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pflalign import checkpoint as ckpt
from pflalign.config import build_config
from pflalign.run.engine import run
from pflalign.run.client_store import client_records
from pflalign.run.adapter_folder import read_adapter
from pflalign.run.export import ADAPTERS, export_run, run_adapters

CLIENTS = ["arithmetic", "sorting"]
# tiny-opt: its random outputs differ from prompt to prompt and between adapters (tiny-llama's
# tied embeddings echo the last prompt token, a special one: every output decodes to "")
TINY = {
    "model": "tiny-opt", "lora": {"r": 4, "alpha": 8},
    "data": {"name": "synthetic", "clients": CLIENTS, "max_train": 12, "max_test": 4},
    "rounds": 2, "local_steps": 5, "batch_size": 2, "max_seq_len": 96, "lr": 0.3,
    "eval": {"max_new_tokens": 12, "batch_size": 4, "base_model": False},
}
METHODS = ["pflalign", "fedsa-lora", "fedsvd"]
OPT_PROMPT = "### Instruction:\n{prompt}\n\n### Response:\n"  # the training prompt format of a model without a chat template


_RUNS: dict = {}


def _finished(method: str, tmp_path_factory):
    """A finished tiny run of `method`, made once per test session."""
    if method not in _RUNS:
        out = tmp_path_factory.mktemp(method) / "run"
        cfg = build_config(None, {**json.loads(json.dumps(TINY)), "method": method})
        run(cfg, out, progress=False)
        _RUNS[method] = out
    return _RUNS[method]


@pytest.fixture(params=METHODS)
def finished(request, tmp_path_factory):
    return request.param, _finished(request.param, tmp_path_factory)


def _plain_peft_outputs(adapter_dir, prompts: list[str], max_new_tokens: int) -> list[str]:
    """Greedy outputs of base + adapter through transformers and PEFT only (the tiny base is
    built in memory: it exists nowhere on disk)."""
    from peft import PeftModel

    from pflalign.model import load_base_model

    base, tok = load_base_model("tiny-opt")
    model = PeftModel.from_pretrained(base, str(adapter_dir)).eval()
    outputs = []
    for prompt in prompts:
        ids = tok(OPT_PROMPT.format(prompt=prompt), return_tensors="pt")
        with torch.no_grad():
            gen = model.generate(**ids, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=tok.pad_token_id)
        outputs.append(tok.decode(gen[0, ids["input_ids"].shape[1]:], skip_special_tokens=True).strip())
    return outputs


def test_finished_run_writes_peft_adapters_equal_to_the_evaluated_models(finished):
    method, out = finished
    folder = out / ADAPTERS
    assert sorted(p.name for p in folder.iterdir()) == sorted(["global", *CLIENTS])
    config = json.loads((folder / "sorting" / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"], config["task_type"]) == (4, 8, "CAUSAL_LM")
    base = Path(config["base_model_name_or_path"])  # the tiny base saved once in the cache (issue 42)
    assert base.is_absolute() and base.name.startswith("tiny-opt-") and (base / "config.json").exists()
    assert sorted(config["target_modules"]) == ["fc1", "fc2", "k_proj", "out_proj", "q_proj", "v_proj"]
    # the tensors are the method's personalized model after aggregation, from the checkpoint
    cfg = build_config(None, json.loads((out / ckpt.CONFIG).read_text()))
    payload = ckpt.load_run_checkpoint(out)
    expected = run_adapters(cfg, payload, CLIENTS, out)
    for name in ["global", *CLIENTS]:
        got = read_adapter(folder / name)
        assert got.keys() == expected[name].keys()
        assert all(torch.equal(got[n], expected[name][n]) for n in got), name
    if method == "fedsa-lora":  # the aggregated A with the client's own B, not its local model
        own = client_records(out, payload)[0]["personalized"]
        assert any(not torch.equal(expected["arithmetic"][n], own[n]) for n in own)


def test_plain_peft_generates_the_runs_predictions(finished):
    """The exported global adapter and two clients' adapters, loaded with PeftModel.from_pretrained,
    give greedy outputs equal to predictions.jsonl for the same prompts."""
    method, out = finished
    preds = [json.loads(line) for line in (out / ckpt.PREDICTIONS).read_text().splitlines()]
    max_new = TINY["eval"]["max_new_tokens"]
    got = _plain_peft_outputs(out / ADAPTERS / "global", [p["prompt"] for p in preds], max_new)
    assert got == [p["global"] for p in preds]
    for client in CLIENTS:
        mine = [p for p in preds if p["task"] == client]
        got = _plain_peft_outputs(out / ADAPTERS / client, [p["prompt"] for p in mine], max_new)
        assert got == [p["personalized"] for p in mine], client
    # not vacuous: the personalized models generate something else than the global one
    assert any(p["personalized"] != p["global"] for p in preds)
    assert any(p["personalized"] for p in preds)


def _predictions(out) -> list[dict]:
    return [json.loads(line) for line in (out / ckpt.PREDICTIONS).read_text().splitlines()]


def test_export_cli_writes_the_same_adapters_from_the_checkpoint(tmp_path_factory, tmp_path, capsys):
    from pflalign.cli import main

    out = _finished("fedsa-lora", tmp_path_factory)
    assert main(["export", str(out), "--out", str(tmp_path / "all")]) == 0
    assert main(["export", str(out), "--out", str(tmp_path / "one"), "--client", "sorting"]) == 0
    assert sorted(p.name for p in (tmp_path / "all").iterdir()) == ["arithmetic", "global", "sorting"]
    assert [p.name for p in (tmp_path / "one").iterdir()] == ["sorting"]
    for name in ["global", "arithmetic", "sorting"]:
        a, b = read_adapter(out / ADAPTERS / name), read_adapter(tmp_path / "all" / name)
        assert a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)
    a, b = read_adapter(out / ADAPTERS / "sorting"), read_adapter(tmp_path / "one" / "sorting")
    assert all(torch.equal(a[n], b[n]) for n in a)
    capsys.readouterr()
    assert main(["export", str(out), "--out", str(tmp_path / "x"), "--client", "nope"]) == 2
    err = capsys.readouterr().err.strip()
    assert "no client 'nope'" in err and "arithmetic, sorting" in err and len(err.splitlines()) == 1
    assert main(["export", str(tmp_path / "missing"), "--out", str(tmp_path / "x")]) == 2


def test_export_merged_loads_with_transformers_alone_and_generates_the_predictions(tmp_path_factory, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from pflalign.cli import main

    out = _finished("fedsa-lora", tmp_path_factory)
    assert main(["export", str(out), "--out", str(tmp_path), "--client", "arithmetic", "--merged"]) == 0
    folder = tmp_path / "arithmetic"
    assert (folder / "model.safetensors").exists() and (folder / "generation_config.json").exists()
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    tok = AutoTokenizer.from_pretrained(folder)
    assert not any("lora" in n for n, _ in model.named_parameters())
    mine = [p for p in _predictions(out) if p["task"] == "arithmetic"]
    for p in mine:
        ids = tok(OPT_PROMPT.format(prompt=p["prompt"]), return_tensors="pt")
        with torch.no_grad():
            gen = model.generate(**ids, max_new_tokens=TINY["eval"]["max_new_tokens"], do_sample=False,
                                 pad_token_id=tok.pad_token_id)
        assert tok.decode(gen[0, ids["input_ids"].shape[1]:], skip_special_tokens=True).strip() == p["personalized"]


def test_an_interrupted_run_exports_from_its_checkpoint(tmp_path):
    from pflalign.cli import main

    cfg = build_config(None, {**json.loads(json.dumps(TINY)), "method": "fedsvd", "rounds": 3})
    assert run(cfg, tmp_path / "run", stop_after=1, progress=False) is None
    assert not (tmp_path / "run" / ADAPTERS).exists()
    assert main(["export", str(tmp_path / "run"), "--out", str(tmp_path / "x")]) == 0
    payload = ckpt.load_run_checkpoint(tmp_path / "run")
    expected = run_adapters(cfg, payload, CLIENTS, tmp_path / "run")
    got = read_adapter(tmp_path / "x" / "sorting")
    assert all(torch.equal(got[n], expected["sorting"][n]) for n in got)
    info = json.loads((tmp_path / "x" / "sorting" / "pflalign.json").read_text())
    assert (info["client"], info["rounds_done"], info["method"]) == ("sorting", 1, "fedsvd")


def test_generate_cli_streams_the_runs_greedy_answers(tmp_path_factory, capsys, monkeypatch):
    import io

    from pflalign.cli import main

    out = _finished("fedsa-lora", tmp_path_factory)
    preds = _predictions(out)
    mine = [p for p in preds if p["task"] == "sorting"]
    max_new = str(TINY["eval"]["max_new_tokens"])
    assert main(["generate", str(out), "--client", "sorting", "--max-new-tokens", max_new, mine[0]["prompt"]]) == 0
    assert capsys.readouterr().out.strip() == mine[0]["personalized"]
    monkeypatch.setattr("sys.stdin", io.StringIO("".join(p["prompt"] + "\n" for p in preds[:2])))
    assert main(["generate", str(out), "--global", "--max-new-tokens", max_new]) == 0
    lines = capsys.readouterr().out.split("\n")
    assert [line.strip() for line in lines[:2]] == [p["global"] for p in preds[:2]]
    assert main(["generate", str(out), "--client", "sorting", "--temperature", "1.0", "--seed", "1",
                 "--max-new-tokens", "3", "hello"]) == 0


def test_generate_cli_bad_client_or_no_adapters_is_one_line_exit_2(tmp_path_factory, tmp_path, capsys):
    import shutil

    from pflalign.cli import main

    out = _finished("fedsa-lora", tmp_path_factory)
    assert main(["generate", str(out), "--client", "nope", "hi"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "no client 'nope'" in err and "arithmetic, sorting" in err
    bare = tmp_path / "bare"
    shutil.copytree(out, bare, ignore=shutil.ignore_patterns(ADAPTERS))
    assert main(["generate", str(bare), "--client", "sorting", "hi"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "has no adapters" in err and "pflalign export" in err
    assert main(["generate", str(out), "hi"]) == 2
    (bare / ckpt.RESULTS).unlink()  # unfinished (e.g. overwritten and interrupted): stale adapters are not used
    shutil.copytree(out / ADAPTERS, bare / ADAPTERS)
    assert main(["generate", str(bare), "--client", "sorting", "hi"]) == 2
    assert "no finished run" in capsys.readouterr().err


def test_exact_match_beside_rouge_l_and_report_metric(tmp_path_factory, tmp_path):
    from pflalign.cli import main
    from pflalign.evaluate import exact_match

    out = _finished("fedsa-lora", tmp_path_factory)
    results = json.loads((out / ckpt.RESULTS).read_text())
    preds = _predictions(out)
    for row in results["clients"]:
        mine = [p for p in preds if p["task"] == row["task"]]
        for kind in ("personalized", "global"):
            assert row[f"exact_match_{kind}"] == exact_match([p[kind] for p in mine], [p["reference"] for p in mine])
        assert row["exact_match_base"] is None  # eval.base_model is off
        assert "rouge_l_personalized" in row
    assert results["avg_exact_match_personalized"] == pytest.approx(
        sum(r["exact_match_personalized"] for r in results["clients"]) / 2)
    assert main(["report", str(out), "--out", str(tmp_path / "em"), "--metric", "exact_match"]) == 0
    assert "Personalized exact match" in (tmp_path / "em" / "report.md").read_text()


# ---- issue 41, item 6: a foreign --out; an interrupted merged export ----------------------------
def test_export_refuses_a_folder_with_other_files_and_writes_again_over_its_own(tmp_path_factory, tmp_path, capsys):
    """As `pflalign run` refuses a foreign --out: export wrote into any folder."""
    from pflalign.cli import main

    out = _finished("fedsa-lora", tmp_path_factory)
    foreign = tmp_path / "model"  # e.g. a Hugging Face model folder
    foreign.mkdir()
    (foreign / "config.json").write_text("{}")
    (foreign / "global").mkdir()  # even a folder named like ours, without its pflalign.json
    capsys.readouterr()
    for target, needle in [(foreign, "is a folder with other files in it, not a folder of pflalign exports"),
                           (foreign / "config.json", "is a file, not a folder")]:
        assert main(["export", str(out), "--out", str(target)]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and needle in err, err
    assert sorted(p.name for p in foreign.iterdir()) == ["config.json", "global"]
    assert list((foreign / "global").iterdir()) == []
    # its own exports: written again (the same adapters), and one client added to them
    assert main(["export", str(out), "--out", str(tmp_path / "mine"), "--client", "sorting"]) == 0
    assert main(["export", str(out), "--out", str(tmp_path / "mine")]) == 0
    assert main(["export", str(out), "--out", str(tmp_path / "mine")]) == 0
    assert sorted(p.name for p in (tmp_path / "mine").iterdir()) == ["arithmetic", "global", "sorting"]
    a, b = read_adapter(out / ADAPTERS / "sorting"), read_adapter(tmp_path / "mine" / "sorting")
    assert all(torch.equal(a[n], b[n]) for n in a)


def test_an_interrupted_merged_export_leaves_no_folder_that_looks_complete(tmp_path_factory, tmp_path,
                                                                           monkeypatch):
    from transformers import PreTrainedTokenizerBase

    out = _finished("fedsa-lora", tmp_path_factory)
    target = tmp_path / "merged"
    export_run(out, target, client="arithmetic", merged=True)
    before = {p.name: p.read_bytes() for p in (target / "arithmetic").iterdir()}

    def interrupted(*args, **kwargs):  # Ctrl-C once the model's weights are written, before its tokenizer
        raise KeyboardInterrupt

    monkeypatch.setattr(PreTrainedTokenizerBase, "save_pretrained", interrupted)
    for client in ("sorting", "arithmetic"):  # a new folder, and one replacing a complete export
        with pytest.raises(KeyboardInterrupt):
            export_run(out, target, client=client, merged=True)
    assert [p.name for p in target.iterdir()] == ["arithmetic"]  # no sorting/, no hidden leftover
    assert {p.name: p.read_bytes() for p in (target / "arithmetic").iterdir()} == before  # the old one, whole
    monkeypatch.undo()
    export_run(out, target, client="sorting", merged=True)
    assert (target / "sorting" / "pflalign.json").is_file() and (target / "sorting" / "model.safetensors").is_file()


# ---- issue 42: adapters that travel --------------------------------------------------------
# transformers and PEFT alone, in a fresh interpreter: what a user without pflalign runs
PLAIN_PEFT = """
import json, sys
import torch
from peft import AutoPeftModelForCausalLM
from transformers import AutoTokenizer

folder, prompts, max_new = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3])
model = AutoPeftModelForCausalLM.from_pretrained(folder).eval()
tok = AutoTokenizer.from_pretrained(model.peft_config["default"].base_model_name_or_path)
outputs = []
for prompt in prompts:
    ids = tok("### Instruction:\\n" + prompt + "\\n\\n### Response:\\n", return_tensors="pt")
    with torch.no_grad():
        gen = model.generate(**ids, max_new_tokens=max_new, do_sample=False, pad_token_id=tok.pad_token_id)
    outputs.append(tok.decode(gen[0, ids["input_ids"].shape[1]:], skip_special_tokens=True).strip())
print(json.dumps({"outputs": outputs, "pflalign_imported": any(m.startswith("pflalign") for m in sys.modules)}))
"""


def _autopeft_outputs(folder, prompts: list[str], cwd) -> list[str]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run([sys.executable, "-c", PLAIN_PEFT, str(folder), json.dumps(prompts),
                           str(TINY["eval"]["max_new_tokens"])], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    reply = json.loads(done.stdout.strip().splitlines()[-1])
    assert not reply["pflalign_imported"]
    return reply["outputs"]


def test_autopeft_loads_exported_adapters_without_pflalign(tmp_path_factory, tmp_path):
    """`AutoPeftModelForCausalLM.from_pretrained(adapter)` alone (its base from adapter_config.json)
    generates the run's predictions: for a run's adapters/, an export, and an export --base-copy."""
    from pflalign.cli import main

    out = _finished("fedsa-lora", tmp_path_factory)
    preds = _predictions(out)
    mine = [p for p in preds if p["task"] == "sorting"]
    assert _autopeft_outputs(out / ADAPTERS / "sorting", [p["prompt"] for p in mine], tmp_path) == \
        [p["personalized"] for p in mine]
    assert main(["export", str(out), "--out", str(tmp_path / "exp"), "--global",
                 "--base-copy", str(tmp_path / "base")]) == 0
    assert [p.name for p in (tmp_path / "exp").iterdir()] == ["global"]
    config = json.loads((tmp_path / "exp" / "global" / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str((tmp_path / "base").resolve())
    assert "tiny-opt" in (tmp_path / "base" / "README.md").read_text()
    assert _autopeft_outputs(tmp_path / "exp" / "global", [p["prompt"] for p in preds], tmp_path) == \
        [p["global"] for p in preds]


def test_gguf_adapters_name_the_dequantized_copy_in_the_cache(tmp_path, monkeypatch):
    """A GGUF base (the embedded SmolLM2 is one) is named by its de-quantized transformers-format
    copy in the model cache, which loads alone with the same tensors and says what it is."""
    from transformers import AutoModelForCausalLM

    from pflalign.run.adapter_folder import base_model
    from pflalign.model import load_base_model
    from tiny_gguf import write_tiny_gguf

    monkeypatch.setenv("PFLALIGN_CACHE", str(tmp_path / "cache"))
    gguf = write_tiny_gguf(tmp_path / "tiny.Q4_1.gguf")
    location, what = base_model(str(gguf))
    folder = Path(location)
    assert folder.parent == tmp_path / "cache" / "dequantized" and "de-quantized" in what
    assert "de-quantized" in (folder / "README.md").read_text()
    plain = AutoModelForCausalLM.from_pretrained(folder)
    ours, _ = load_base_model(str(gguf))
    theirs = dict(plain.state_dict())
    assert all(torch.equal(t, theirs[n]) for n, t in ours.state_dict().items())
    assert "Q4_1" in base_model("smollm2-135m", copy=tmp_path / "copy")[1]  # the embedded one says Q4_1 (not loaded)


def test_every_adapter_folder_has_a_model_card_and_readable_files(tmp_path_factory, tmp_path):
    import dataclasses

    from pflalign.cli import main
    from pflalign.config import method_args

    out = _finished("pflalign", tmp_path_factory)
    results = json.loads((out / ckpt.RESULTS).read_text())
    row = next(r for r in results["clients"] if r["task"] == "sorting")
    card = (out / ADAPTERS / "sorting" / "README.md").read_text()
    assert card.startswith("---\nlibrary_name: peft\n") and "client sorting's personalized model" in card
    args = dataclasses.asdict(method_args(build_config(None, json.loads((out / ckpt.CONFIG).read_text()))))
    assert "beta" in args and f"arguments `{json.dumps(args)}`" in card  # the method's resolved arguments
    assert "pflalign" in card and "partition natural" in card and "rounds: 2 of 2" in card
    assert f"| sorting | {row['n_train']} | {row['n_test']} | {row['rouge_l_personalized']:.2f} " in card
    assert "arithmetic |" not in card  # only its own scores
    global_card = (out / ADAPTERS / "global" / "README.md").read_text()
    assert "the global model" in global_card and "| arithmetic |" in global_card and "| sorting |" in global_card
    assert main(["export", str(out), "--out", str(tmp_path / "m"), "--client", "arithmetic", "--merged"]) == 0
    for folder in [out / ADAPTERS / "sorting", tmp_path / "m" / "arithmetic"]:
        modes = {p.name: oct(p.stat().st_mode & 0o777) for p in folder.iterdir()}
        assert set(modes.values()) == {"0o644"}, modes
    assert "model.safetensors" in os.listdir(tmp_path / "m" / "arithmetic")
    assert "AutoModelForCausalLM" in (tmp_path / "m" / "arithmetic" / "README.md").read_text()


@pytest.mark.parametrize("umask", [0o077, 0o022])
def test_a_run_and_its_export_follow_the_umask(tmp_path, umask):
    """Issue 57: what a run and an export write gets the mode a plain write gets under the
    user's umask: under 077 nobody else can read adapters trained on private data (they were
    forced to 0644 before), under 022 every file is 0644 and every folder 0755."""
    from pflalign.cli import main

    old = os.umask(umask)
    try:
        out = tmp_path / "run"
        run(build_config(None, {**json.loads(json.dumps(TINY)), "method": "fedavg", "rounds": 1}), out, progress=False)
        assert main(["export", str(out), "--out", str(tmp_path / "exp"), "--client", "sorting", "--merged"]) == 0
        assert main(["export", str(out), "--out", str(tmp_path / "exp"), "--global"]) == 0
    finally:
        os.umask(old)
    written = [p for p in [out, *out.rglob("*"), tmp_path / "exp", *(tmp_path / "exp").rglob("*")]]
    assert any(p.name == "adapter_model.safetensors" for p in written)
    assert any(p.name == "model.safetensors" for p in written)  # transformers writes it 0600 whatever the umask
    assert any(p.name == "checkpoint.pt" for p in written)
    modes = {str(p.relative_to(tmp_path)): p.stat().st_mode & 0o777 for p in written}
    want = {p: (0o777 if (tmp_path / p).is_dir() else 0o666) & ~umask for p in modes}
    assert modes == want, {p: oct(m) for p, m in modes.items() if m != want[p]}


def test_generate_on_an_exported_folder(tmp_path_factory, tmp_path, capsys):
    from pflalign.cli import main

    out = _finished("fedsa-lora", tmp_path_factory)
    mine = [p for p in _predictions(out) if p["task"] == "sorting"]
    max_new = str(TINY["eval"]["max_new_tokens"])
    assert main(["export", str(out), "--out", str(tmp_path / "exp")]) == 0
    capsys.readouterr()
    for args in (["--client", "sorting"], []):  # the export folder, one adapter folder
        folder = tmp_path / "exp" if args else tmp_path / "exp" / "sorting"
        assert main(["generate", str(folder), *args, "--max-new-tokens", max_new, mine[0]["prompt"]]) == 0
        assert capsys.readouterr().out.strip() == mine[0]["personalized"]
    assert main(["generate", str(tmp_path / "exp" / "sorting"), "--global", "hi"]) == 2
    assert "no global model" in capsys.readouterr().err
    assert main(["generate", str(tmp_path / "nothing"), "--global", "hi"]) == 2


def test_generate_on_a_damaged_export_is_one_line_naming_the_file(tmp_path_factory, tmp_path, capsys):
    """Issue 57: a truncated ``adapter_model.safetensors`` (or a damaged adapter_config.json) is
    one line naming it and exit 2, not safetensors' traceback (`export.read_adapter`, the loader
    `generate` and `export --merged` share)."""
    from pflalign.cli import main

    out = _finished("pflalign", tmp_path_factory)
    assert main(["export", str(out), "--out", str(tmp_path / "exp"), "--global"]) == 0
    weights = tmp_path / "exp" / "global" / "adapter_model.safetensors"
    data = weights.read_bytes()
    for damage, name in [(data[:len(data) // 2], weights), (b"", weights), (b"not json", weights.with_name("adapter_config.json"))]:
        broken = tmp_path / "broken"
        shutil.rmtree(broken, ignore_errors=True)
        shutil.copytree(tmp_path / "exp", broken)
        (broken / "global" / name.name).write_bytes(damage)
        capsys.readouterr()
        assert main(["generate", str(broken), "--global", "--max-new-tokens", "2", "hi"]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and str(broken / "global" / name.name) in err and "damaged" in err, err
        assert "Traceback" not in err


def test_base_and_card_for_a_hub_id_a_folder_and_an_unscored_client(tmp_path):
    from pflalign.run.adapter_folder import base_model
    from pflalign.run.model_card import model_card

    assert base_model("meta-llama/Llama-3.2-1B-Instruct") == \
        ("meta-llama/Llama-3.2-1B-Instruct", "the Hugging Face hub model meta-llama/Llama-3.2-1B-Instruct")
    (tmp_path / "mymodel").mkdir()
    assert base_model(str(tmp_path / "mymodel"))[0] == str((tmp_path / "mymodel").resolve())
    cfg = build_config(None, {**json.loads(json.dumps(TINY)), "model": "meta-llama/Llama-3.2-1B-Instruct"})
    results = {"avg_rouge_l_global": 1.0, "clients_in_federation": 3,
               "clients": [{"task": "sorting", "n_train": 12, "n_test": 4, "rouge_l_personalized": 12.5,
                            "rouge_l_global": 10.0, "rouge_l_base": None, "exact_match_personalized": 25.0}]}
    base = base_model(cfg.model)
    card = model_card(cfg, "sorting", base, results)
    assert "\nbase_model: meta-llama/Llama-3.2-1B-Instruct\n" in card and ", 3 clients\n" in card
    assert "| sorting | 12 | 4 | 12.50 (25.00) | 10.00 (-) | - (-) |" in card
    assert "not among the clients scored" in model_card(cfg, "arithmetic", base, results)
    assert "Not scored" in model_card(cfg, "arithmetic", base, None)


def test_a_gguf_base_that_cannot_be_cached_is_named_with_what_old_transformers_need(tmp_path, monkeypatch):
    """Without a writable cache the adapters name the GGUF itself; its sentence says what a user on
    transformers 5.0-5.17 must set, which swap that GGUF tokenizer's BOS and EOS on loading."""
    from pflalign.model import model_cache
    from pflalign.run.adapter_folder import base_model

    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"")
    monkeypatch.setattr(model_cache, "cached_folder", lambda *a, **k: None)
    location, what = base_model(str(gguf))
    assert location == str(gguf.resolve())
    assert "gguf_file=" in what and "bos_token" in what and "5.0-5.17" in what
