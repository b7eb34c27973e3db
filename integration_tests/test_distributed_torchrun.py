"""AdaDSF's building blocks under ``torchrun``: 2 gloo processes on a tiny Llama (CPU).

One ``torchrun`` launch runs every scenario below (this file is also the script it
runs, see ``worker``); each rank writes what it measured, and the tests compare the
ranks with each other and with a single-process run of the same thing in this process:

* calibration similarities over two partitions == one process over their union;
* router warm start: identical routers on both ranks;
* causal thresholds fit on both ranks' scores == one process over the union (exact);
* ridge skip paths: identical maps on both ranks, == one process over the union; with
  the routers refit to the skip error (``router_init: skip_error``), identical routers
  and maps on both ranks;
* alignment, DDP: each rank trains on its half of the rows; == one process training on
  the concatenated batch (rows of different lengths, so each rank's loss must be
  weighted by its share of the tokens); identical weights on both ranks;
* alignment, FSDP2 (``align_parallel="fsdp"``): == the DDP path, and the student is
  left a plain module (no FSDP class, hooks or DTensors);
* AdaDSF + GPTQ in one recipe: every quantized weight, scale and router identical on
  both ranks;
* clear errors, raised on both ranks: fewer calibration batches than ranks, ranks
  with different model configs or weights, a save from ranks whose routers differ.

A second launch runs ``adadsf compress`` (AdaDSF + GPTQ W8A8) under ``torchrun``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from tiny_models import save_tiny_model, tiny_model, token_dataset  # noqa: E402

from adadsf_modifier.alignment import (  # noqa: E402
    AlignmentConfig,
    align_model,
    make_teacher,
)
from adadsf_modifier.fitting import (  # noqa: E402
    RouterRefit,
    calibrate_thresholds,
    fit_skip_paths,
)
from adadsf_modifier.fitting.calibration import SimilarityAccumulator  # noqa: E402
from adadsf_modifier.routing import TokenRouter, decoder_layers, route_layer  # noqa: E402
from adadsf_modifier.utils import run_calibration_batches  # noqa: E402

pytestmark = pytest.mark.integration

RATIOS = (0.5, 0.6, 0.7, 0.8)
ROW_LENGTHS = (16, 12, 8, 14)  # alignment rows: unequal token counts per rank
ALIGN_STEPS = 3


# ------------------------------------------------------------------ shared setup
def routed_tiny():
    """The same dense tiny Llama, its teacher and seeded routers on every process."""
    model = tiny_model("llama", 4, seed=0)
    teacher = make_teacher(model)
    spec, layers = decoder_layers(model)
    torch.manual_seed(1)
    for i, (_, layer) in enumerate(layers):
        router = TokenRouter(model.config.hidden_size, 16)
        route_layer(layer, router, RATIOS[i], i, spec.cache_kwarg, model.config)
    return model, teacher


def calibration_batches() -> list[dict[str, torch.Tensor]]:
    """8 rows of 16 tokens as 4 batches of 2; rank ``r`` of 2 takes batches 2r, 2r+1."""
    ids = torch.randint(4, 128, (8, 16), generator=torch.Generator().manual_seed(2))
    return [
        {"input_ids": ids[i : i + 2], "attention_mask": torch.ones(2, 16, dtype=int)}
        for i in range(0, 8, 2)
    ]


def alignment_rows() -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    return [
        {"input_ids": torch.randint(4, 128, (n,), generator=g)} for n in ROW_LENGTHS
    ]


def similarities(batches) -> list[float]:
    model = tiny_model("llama", 4, seed=0)
    _, layers = decoder_layers(model)
    acc = SimilarityAccumulator(len(layers))
    with acc.capturing([layer for _, layer in layers]):
        run_calibration_batches(model.base_model, batches)
    acc.all_reduce()
    return acc.similarities()


def skip_paths(
    batches, refit: RouterRefit | None = None, thresholds: bool = False
) -> dict:
    """Ridge skip paths (rank 4, penalty chosen per layer) fit on ``batches``; with
    ``thresholds``, the causal thresholds fitted in the same walk."""
    model, _ = routed_tiny()
    report = fit_skip_paths(
        model, batches, rank=4, refit_routers=refit, fit_thresholds=thresholds
    )
    maps = {k: v.clone() for k, v in model.state_dict().items() if "skip_path" in k}
    out = {"maps": maps, "routers": trained(model, "routers")}
    if thresholds:
        out["thresholds"] = torch.tensor(report.thresholds.thresholds)
        out["kept"] = torch.tensor(report.thresholds.kept_fraction)
    return out


def align(parallel: str, batch_size: int, trainable: str = "routers"):
    model, teacher = routed_tiny()
    config = AlignmentConfig(
        align_steps=ALIGN_STEPS,
        align_batch_size=batch_size,
        align_trainable=trainable,
        align_parallel=parallel,
    )
    report = align_model(model, teacher, alignment_rows(), config, show_progress=False)
    return model, report


def leftovers(model) -> dict:
    """FSDP classes and DTensor parameters left on ``model``, and its hook counts."""
    return {
        "fsdp": [
            type(m).__name__ for m in model.modules() if "FSDP" in type(m).__name__
        ],
        "dtensors": [n for n, p in model.named_parameters() if hasattr(p, "to_local")],
        "hooks": {
            n: (len(m._forward_hooks), len(m._forward_pre_hooks))
            for n, m in model.named_modules()
        },
    }


def trained(model, trainable: str, frozen: bool = False) -> dict[str, torch.Tensor]:
    """The parameters ``trainable`` trains (``frozen``: all the others)."""
    keep = ".router." if trainable == "routers" else ".layers."
    return {
        n: p.detach().clone()
        for n, p in model.named_parameters()
        if (keep in n) != frozen
    }


# ------------------------------------------------------------------ the worker
def worker(out: Path, model_dir: str) -> None:  # pragma: no cover - runs in torchrun
    import gc

    import torch.distributed as dist
    from llmcompressor import oneshot
    from llmcompressor.modifiers.gptq import GPTQModifier
    from torch.nn.parallel import DistributedDataParallel
    from transformers import AutoModelForCausalLM

    from adadsf_modifier import AdaDSFModifier, distributed, routed_layers
    from adadsf_modifier.checkpoint import attach_checkpoint_support
    from adadsf_modifier.fitting.warm_start import warm_start_routers

    torch.set_num_threads(1)
    assert distributed.init_distributed() and distributed.world_size() == 2
    rank = distributed.rank()
    mine = calibration_batches()[2 * rank : 2 * rank + 2]
    res: dict = {"similarities": similarities(mine)}

    # warm start from both ranks' samples: one rank fits each router
    model, _ = routed_tiny()
    _, layers = decoder_layers(model)
    acc = SimilarityAccumulator(len(layers), sample_tokens=24, seed=0)
    with acc.capturing([layer for _, layer in layers]):
        run_calibration_batches(model.base_model, mine)
    reports = warm_start_routers(model, acc.local_sample, steps=5)
    res["warm_start"] = {
        "routers": trained(model, "routers"),
        "tokens": [r.tokens for r in reports],
        "loss_last": [r.loss_last for r in reports],
    }

    model, _ = routed_tiny()
    report = calibrate_thresholds(model, mine)
    res["thresholds"] = {
        "thresholds": report.thresholds,
        "kept": report.kept_fraction,
        "tokens": report.num_tokens,
    }
    res["skip_paths"] = skip_paths(mine)
    res["skip_paths_refit"] = skip_paths(mine, RouterRefit(tokens=24, steps=5))
    res["skip_paths_thresholds"] = skip_paths(
        mine, RouterRefit(tokens=24, steps=5), thresholds=True
    )

    for parallel, trainable in (
        ("ddp", "routers"),
        ("fsdp", "routers"),
        ("ddp", "routers_and_layers"),
        ("fsdp", "routers_and_layers"),
    ):
        model, report = align(parallel, batch_size=2, trainable=trainable)
        res[f"align_{parallel}_{trainable}"] = {
            "params": trained(model, trainable),
            "frozen": trained(model, trainable, frozen=True),
            "losses": report.losses,
            "rows": report.num_rows,
            "left": leftovers(model),
        }
        del model
    gc.collect()
    res["ddp_alive"] = sum(
        isinstance(o, DistributedDataParallel) for o in gc.get_objects()
    )

    # AdaDSF stacked with GPTQ: every tensor identical on both ranks, even when the
    # rank that owns a module writes its quantized weights late (on CPU they are in
    # shared memory, written in place: adadsf_modifier/qparam_sync.py)
    import llmcompressor.modifiers.gptq.base as gptq_base

    write = gptq_base.update_batch_qparams

    def late_write(*args, **kwargs):
        if rank == 1:
            time.sleep(0.5)
        return write(*args, **kwargs)

    gptq_base.update_batch_qparams = late_write
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    oneshot(
        model=model,
        dataset=token_dataset(16, 16),
        num_calibration_samples=16,
        recipe=[
            AdaDSFModifier(retention=0.7, router_init_steps=10, align_steps=2),
            GPTQModifier(
                targets="Linear", scheme="W8A8", ignore=["lm_head", "re:.*router.*"]
            ),
        ],
    )
    gptq_base.update_batch_qparams = write
    res["gptq"] = {
        n: float(t.detach().double().sum())
        for n, t in model.state_dict().items()
        if t.is_floating_point() or t.dtype == torch.int8
    }
    res["gptq_quantized"] = sum(n.endswith("weight_scale") for n in res["gptq"])

    # clear errors, raised on both ranks
    def error_of(fn) -> str:
        try:
            fn()
        except Exception as e:  # noqa: BLE001 - the message is the result
            return f"{type(e).__name__}: {e}"
        return "no error"

    one_batch = [calibration_batches()[0]]
    res["err_batches"] = error_of(lambda: distributed.rank_batches(one_batch))
    res["err_oneshot_batches"] = error_of(
        lambda: oneshot(
            model=AutoModelForCausalLM.from_pretrained(model_dir),
            dataset=token_dataset(1, 16),
            num_calibration_samples=1,
            shuffle_calibration_samples=False,
            recipe=[AdaDSFModifier(retention=0.7)],
        )
    )
    res["err_weights"] = error_of(
        lambda: distributed.check_same_model(tiny_model("llama", 4, seed=rank), {})
    )
    res["err_config"] = error_of(
        lambda: oneshot(
            model=AutoModelForCausalLM.from_pretrained(
                model_dir, num_hidden_layers=4 - rank
            ),
            dataset=token_dataset(8, 16),
            num_calibration_samples=8,
            recipe=[AdaDSFModifier(retention=0.7)],
        )
    )
    # ranks that disagree on a router: the checkpoint would depend on the rank
    model, _ = routed_tiny()
    if rank == 1:
        with torch.no_grad():
            routed_layers(model)[2].router.fc2.bias.add_(1e-3)
    attach_checkpoint_support(model)
    res["err_save"] = error_of(lambda: model.save_pretrained(str(out / "disagree")))
    res["saved_anything"] = (out / "disagree").exists()
    torch.save(res, out / f"rank{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()


# ------------------------------------------------------------------ launching
def torchrun(args: list[str], timeout: float = 600) -> None:
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join(
            [str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])]
        ),
    }
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    proc = subprocess.run(
        [*cmd, "--nproc_per_node", "2", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=REPO,
    )
    if proc.returncode != 0:
        print(proc.stdout[-4000:], proc.stderr[-8000:])
    assert proc.returncode == 0


@pytest.fixture(scope="module")
def ranks(tmp_path_factory, one_thread):
    out = tmp_path_factory.mktemp("distributed")
    model_dir = save_tiny_model("llama", str(out / "tiny"))
    torchrun([__file__, str(out), model_dir])
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in (0, 1)]


def assert_same(a, b, atol: float = 0.0):
    if isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            assert_same(a[k], b[k], atol)
    elif isinstance(a, torch.Tensor):
        torch.testing.assert_close(a, b, rtol=0, atol=atol)
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            assert_same(x, y, atol)
    else:
        assert a == b or abs(a - b) <= atol, (a, b)


# ------------------------------------------------------------------ the tests
def test_similarities_equal_one_process_over_the_union(ranks):
    assert ranks[0]["similarities"] == ranks[1]["similarities"]
    single = similarities(calibration_batches())
    assert_same(ranks[0]["similarities"], single, atol=1e-12)


def test_warm_started_routers_identical_on_both_ranks(ranks):
    assert_same(ranks[0]["warm_start"], ranks[1]["warm_start"])
    # a budget of 24 is 12 per rank, taken a quarter (3) per batch from 2 batches:
    # the fit saw 6 tokens from each rank
    assert ranks[0]["warm_start"]["tokens"] == [12] * len(RATIOS)


def test_thresholds_from_both_ranks_scores_equal_one_process(ranks):
    assert_same(ranks[0]["thresholds"], ranks[1]["thresholds"])
    model, _ = routed_tiny()
    report = calibrate_thresholds(model, calibration_batches())
    assert ranks[0]["thresholds"]["thresholds"] == report.thresholds
    assert ranks[0]["thresholds"]["kept"] == report.kept_fraction
    assert ranks[0]["thresholds"]["tokens"] == report.num_tokens == 8 * 16


def test_skip_paths_fit_on_both_ranks_equal_one_process_over_the_union(ranks):
    assert_same(ranks[0]["skip_paths"], ranks[1]["skip_paths"])
    # the regression sums are reduced over the ranks (float64, another order)
    assert_same(ranks[0]["skip_paths"], skip_paths(calibration_batches()), atol=1e-5)


def test_thresholds_fitted_in_the_skip_walk_equal_on_both_ranks(ranks):
    # every rank fits each threshold on all ranks' scores, so they agree to the bit
    walked = ranks[0]["skip_paths_thresholds"]
    assert_same(walked, ranks[1]["skip_paths_thresholds"])
    assert len(walked["thresholds"]) == len(walked["kept"]) > 0


def test_routers_refit_to_the_skip_error_identical_on_both_ranks(ranks):
    refit = ranks[0]["skip_paths_refit"]
    assert_same(refit, ranks[1]["skip_paths_refit"])
    before = ranks[0]["skip_paths"]["routers"]
    assert any(not torch.equal(refit["routers"][k], before[k]) for k in before)


@pytest.mark.parametrize("trainable", ["routers", "routers_and_layers"])
def test_ddp_alignment_equals_one_process_on_the_concatenated_batch(ranks, trainable):
    key = f"align_ddp_{trainable}"
    assert_same(ranks[0][key], ranks[1][key])  # identical weights on both ranks
    model, report = align("ddp", batch_size=len(ROW_LENGTHS), trainable=trainable)
    assert ranks[0][key]["rows"] == report.num_rows == len(ROW_LENGTHS)
    assert_same(ranks[0][key]["losses"], report.losses, atol=1e-6)
    assert_same(ranks[0][key]["params"], trained(model, trainable), atol=1e-5)
    # the stage moved the weights, so the comparison can fail
    before, _ = routed_tiny()
    moved = trained(before, trainable)
    assert any(not torch.equal(moved[n], p) for n, p in ranks[0][key]["params"].items())


@pytest.mark.parametrize("trainable", ["routers", "routers_and_layers"])
def test_fsdp_alignment_matches_ddp_and_leaves_a_plain_model(ranks, trainable):
    fsdp, ddp = ranks[0][f"align_fsdp_{trainable}"], ranks[0][f"align_ddp_{trainable}"]
    assert_same(fsdp, ranks[1][f"align_fsdp_{trainable}"])
    assert_same(fsdp["losses"], ddp["losses"], atol=1e-6)
    assert_same(fsdp["params"], ddp["params"], atol=1e-5)
    # no FSDP class, DTensor or hook left: FSDP trained a shell of the student, so the
    # student is as fresh (transformers adds its output-recording hooks at the first
    # forward), the DDP one as after alignment in one process
    # FSDP emptied the student's own weights while its shards trained: all are back
    assert_same(fsdp["frozen"], trained(routed_tiny()[0], trainable, frozen=True))
    fresh = leftovers(routed_tiny()[0])
    single = leftovers(align("ddp", len(ROW_LENGTHS), trainable)[0])
    assert fresh["fsdp"] == fresh["dtensors"] == single["fsdp"] == []
    assert fsdp["left"] == fresh and ddp["left"] == single


def test_ddp_wrappers_are_released(ranks):
    assert ranks[0]["ddp_alive"] == ranks[1]["ddp_alive"] == 0


def test_stacked_gptq_gives_identical_tensors_on_both_ranks(ranks):
    assert ranks[0]["gptq_quantized"] > 0
    assert any(".router." in n for n in ranks[0]["gptq"])
    assert ranks[0]["gptq"] == ranks[1]["gptq"]


def test_errors_are_clear_and_raised_on_every_rank(ranks):
    for r in ranks:
        assert "1 calibration batches for 2 ranks" in r["err_batches"]
        assert "at least one per rank" in r["err_batches"]
        assert "ranks [0] got none" in r["err_oneshot_batches"], r
        assert "model weights (shape, checksum) differs" in r["err_weights"]
        assert "model config differs between ranks" in r["err_config"]
        assert "num_hidden_layers: 4 vs 3" in r["err_config"]
        assert "router weights differs between ranks" in r["err_save"]
        assert "model.layers.2.router.fc2.bias" in r["err_save"]
        assert "would depend on the rank" in r["err_save"]
        assert not r["saved_anything"]


# ------------------------------------------------------------------ the CLI
def test_cli_compress_under_torchrun_writes_a_reloadable_quantized_checkpoint(
    tmp_path, one_thread
):
    import yaml

    from adadsf_modifier import RoutedLayer, from_pretrained

    model_dir = save_tiny_model("llama", str(tmp_path / "tiny"))
    recipe = tmp_path / "recipe.yaml"
    adadsf = {"retention": 0.7, "align_steps": 2, "router_init_steps": 10}
    gptq = {
        "targets": ["Linear"],
        "scheme": "W8A8",
        "ignore": ["lm_head", "re:.*router.*"],
    }
    recipe.write_text(
        yaml.safe_dump(
            {
                "sparsity_stage": {"sparsity_modifiers": {"AdaDSFModifier": adadsf}},
                "quantization_stage": {
                    "quantization_modifiers": {"GPTQModifier": gptq}
                },
            },
            sort_keys=False,
        )
    )
    out = tmp_path / "out"
    cli = ["-m", "adadsf_modifier.cli", "compress", "--model", model_dir]
    cli += ["--recipe", str(recipe), "--output-dir", str(out)]
    torchrun([*cli, "--calibration-samples", "8", "--seq-len", "32"])
    assert (out / "adadsf_config.json").is_file()
    assert "quantization_config" in json.loads((out / "config.json").read_text())
    model = from_pretrained(str(out))
    assert sum(isinstance(m, RoutedLayer) for m in model.modules()) == 4
    ids = torch.tensor([[5, 6, 7, 8]])
    assert model.generate(ids, max_new_tokens=3, do_sample=False).shape == (1, 7)


if __name__ == "__main__":
    worker(Path(sys.argv[1]), sys.argv[2])
