"""`adadsf compress --dataset` on the real SmolLM2-135M: the calibration provably
reads the user's text. The layers' similarities in the checkpoint equal those of a
Python ``oneshot`` given the same rows, and differ from the embedded text's.
Runs in CI (the paper's recipe, no alignment: seconds per compression)."""

import inspect
import json
import json.decoder
import json.encoder
import json.scanner

import pytest
from transformers import AutoTokenizer

from adadsf_modifier.cli import main
from adadsf_modifier.evaluation import calibration_dataset, embedded_model_path
from adadsf_modifier.evaluation.text_splits import packed_rows

pytestmark = pytest.mark.integration

RECIPE = "recipes/adadsf_paper.yaml"
ROWS, SEQ_LEN = 4, 64


def _code_documents() -> list[str]:
    """Python source: text no calibration corpus of the embedded model resembles."""
    return [inspect.getsource(m) for m in (json.decoder, json.encoder, json.scanner)]


def _similarities(dataset, tmp_path, name) -> list[float]:
    """The similarities a Python ``oneshot`` of the recipe on ``dataset`` saves."""
    from llmcompressor import oneshot

    out = tmp_path / name
    oneshot(model=embedded_model_path(), dataset=dataset, recipe=RECIPE,
            output_dir=str(out), num_calibration_samples=ROWS,
            max_seq_length=SEQ_LEN)  # fmt: skip
    return _saved_similarities(out)


def _saved_similarities(folder) -> list[float]:
    sidecar = json.loads((folder / "adadsf_config.json").read_text())
    return [layer["similarity"] for layer in sidecar["layers"]]


def test_compress_calibrates_on_a_jsonl_of_code_as_oneshot_does(tmp_path, one_thread):
    docs = _code_documents()
    source = tmp_path / "code.jsonl"
    source.write_text("\n".join(json.dumps({"text": d}) for d in docs))
    out = tmp_path / "cli"
    argv = ["compress", "--recipe", RECIPE, "--dataset", str(source),
            "--calibration-samples", str(ROWS), "--seq-len", str(SEQ_LEN),
            "--output-dir", str(out)]  # fmt: skip
    assert main(argv) == 0
    from_cli = _saved_similarities(out)
    tok = AutoTokenizer.from_pretrained(embedded_model_path())
    same_rows = packed_rows(tok, docs, ROWS, SEQ_LEN, "code")
    assert _similarities(same_rows, tmp_path, "python") == pytest.approx(
        from_cli, abs=1e-6
    )
    embedded = calibration_dataset(tok, ROWS, SEQ_LEN, seed=0)
    other = _similarities(embedded, tmp_path, "embedded")
    assert max(abs(a - b) for a, b in zip(other, from_cli)) > 1e-3
    # the same documents as a local `datasets` folder calibrate alike
    import datasets

    folder = tmp_path / "code_folder"
    datasets.Dataset.from_dict({"text": docs}).save_to_disk(str(folder))
    argv[argv.index(str(source))] = str(folder)
    argv[argv.index(str(out))] = str(tmp_path / "cli_folder")
    assert main(argv) == 0
    assert _saved_similarities(tmp_path / "cli_folder") == from_cli
