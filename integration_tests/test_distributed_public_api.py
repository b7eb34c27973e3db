"""The public API under ``torchrun``: what a user writes, on 2 gloo processes (CPU).

This file is also the script (run from the repository root)::

    torchrun --standalone --nproc_per_node 2 \\
        integration_tests/test_distributed_public_api.py MODEL_DIR OUT_DIR

Each rank loads the same tiny Llama and calls ``oneshot(model, dataset,
recipe=[AdaDSFModifier(retention=0.7, align_steps=4)], output_dir=...)`` on the same
64 calibration rows (llm-compressor hands each rank 32 of them). The script itself
gathers every rank's ``similarities``, ``retention_ratios``, router weights and each
routed layer's ``causal_threshold`` and exits non-zero unless they are identical on
every rank; rank 0 writes them, with its in-memory logits, for the test below. The test
then compares them with one process over the same 64 rows (similarities and ratios:
within 1e-5; routers and thresholds legitimately differ from one process, which warm
starts from another token sample and aligns on other batches) and reloads the
checkpoint the source rank saved.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO / "integration_tests"))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from tiny_models import save_tiny_model, token_dataset  # noqa: E402

pytestmark = pytest.mark.integration

PROBE = torch.tensor([[5, 17, 33, 90, 4, 61, 12, 100, 7, 8, 9, 10]])


def run(model_dir: str, output_dir: str | None = None):
    """``oneshot`` exactly as a user calls it; returns the model and the modifier."""
    from llmcompressor import oneshot
    from transformers import AutoModelForCausalLM

    from adadsf_modifier import AdaDSFModifier

    model = AutoModelForCausalLM.from_pretrained(model_dir)
    modifier = AdaDSFModifier(retention=0.7, align_steps=4)
    oneshot(
        model=model,
        dataset=token_dataset(64, 16),
        num_calibration_samples=64,
        recipe=[modifier],
        output_dir=output_dir,
    )
    return model, modifier


def observe(model, modifier) -> dict:
    from adadsf_modifier import routed_layers

    with torch.no_grad():
        logits = model.eval()(input_ids=PROBE).logits
    return {
        "similarities": modifier.similarities,
        "retention_ratios": modifier.retention_ratios,
        "routers": {
            n: p.detach().clone()
            for n, p in model.named_parameters()
            if ".router." in n
        },
        "thresholds": [m.causal_threshold for m in routed_layers(model)],
        "align_rows": modifier.alignment_report.num_rows,
        "logits": logits,
    }


def main(model_dir: str, out: Path) -> int:  # pragma: no cover - runs in torchrun
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo")  # a CPU machine: compressed-tensors' init_dist
    model, modifier = run(model_dir, str(out / "checkpoint"))
    mine = observe(model, modifier)
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, {k: v for k, v in mine.items()})
    differ = []
    for r, other in enumerate(everyone):
        for key in ("similarities", "retention_ratios", "thresholds", "align_rows"):
            if other[key] != everyone[0][key]:
                differ.append((r, key))
        for name, w in other["routers"].items():
            if not torch.equal(w, everyone[0]["routers"][name]):
                differ.append((r, name))
    if dist.get_rank() == 0:
        torch.save(mine, out / "rank0.pt")
    dist.destroy_process_group()
    if differ:
        print(f"ranks disagree: {differ}", file=sys.stderr)
        return 1
    return 0


@pytest.fixture(scope="module")
def launched(tmp_path_factory, one_thread):
    from test_distributed_torchrun import torchrun

    out = tmp_path_factory.mktemp("public_api")
    model_dir = save_tiny_model("llama", str(out / "tiny"))
    torchrun([__file__, model_dir, str(out)])
    return model_dir, out, torch.load(out / "rank0.pt", weights_only=False)


def test_two_processes_agree_and_match_one_process(launched):
    model_dir, _, two = launched  # the script checked rank 0 == rank 1
    model, modifier = run(model_dir)
    one = observe(model, modifier)
    torch.testing.assert_close(
        torch.tensor(two["similarities"]),
        torch.tensor(one["similarities"]),
        atol=1e-5,
        rtol=0,
    )
    torch.testing.assert_close(
        torch.tensor(two["retention_ratios"]),
        torch.tensor(one["retention_ratios"]),
        atol=1e-5,
        rtol=0,
    )
    # every calibration row trained once: the ranks' shares were not split again
    assert two["align_rows"] == one["align_rows"] == 64
    assert two["routers"].keys() == one["routers"].keys()
    assert len(two["thresholds"]) == len(one["thresholds"]) == 4


def test_checkpoint_saved_by_the_source_rank_reloads_as_the_in_memory_model(launched):
    from adadsf_modifier import from_pretrained, routed_layers

    _, out, two = launched
    model = from_pretrained(str(out / "checkpoint"))
    routers = {n: p for n, p in model.named_parameters() if ".router." in n}
    assert routers.keys() == two["routers"].keys()
    for name, w in routers.items():
        torch.testing.assert_close(w, two["routers"][name], rtol=0, atol=0)
    assert [m.causal_threshold for m in routed_layers(model)] == two["thresholds"]
    with torch.no_grad():
        logits = model.eval()(input_ids=PROBE).logits
    torch.testing.assert_close(logits, two["logits"], rtol=0, atol=0)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], Path(sys.argv[2])))
