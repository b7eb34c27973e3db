"""A cached study run is keyed by what determines its numbers, not by the source text:
editing the lab's presentation or the plug-in's CLI leaves every cached run reused;
bumping an area's ``ALGORITHM_VERSIONS`` recomputes exactly the runs that exercise it;
and a recomputed tiny run reproduces the numbers its cache recorded, so a change that
moves numbers without a version bump fails here."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from tiny_models import save_tiny_model

import adadsf_lab
import adadsf_modifier
from adadsf_lab.study.arms import Tuned
from adadsf_lab.study.methods import METHODS
from adadsf_lab.study.plan import Context, main_specs
from adadsf_lab.study.runner import RunEnv, execute_run
from adadsf_lab.study.settings import StudySettings
from adadsf_lab.study.spec import code_versions, model_fingerprint
from adadsf_modifier.algorithm_versions import ALGORITHM_VERSIONS

PLUGIN = Path(adadsf_modifier.__file__).parent
LAB = Path(adadsf_lab.__file__).parent
TESTS = Path(__file__).resolve().parent

# studies run in a subprocess against a copy of both packages, with a stand-in
# executor: each prints the runs it computed (the others came from the cache). Each
# argument after the paths is a study to run in turn: "-" as the code stands, or
# "AREA=N", the study after ALGORITHM_VERSIONS[AREA] = N.
STUDY = """
import sys
from adadsf_modifier.algorithm_versions import ALGORITHM_VERSIONS
from adadsf_lab.study.settings import StudySettings
from adadsf_lab.study.study import run_study
from test_study_run import fake_executor
s = StudySettings(methods=("dense", "uniform", "ftp"), budgets=(0.8,), seeds=1,
                  tune=False, calib_samples=2, calib_seq_len=16, align_steps=2,
                  align_batch_size=1, align_seq_len=16, tasks=(), speed=False,
                  ppl_tokens=64, ppl_val_tokens=64, ppl_max_length=32, ppl_stride=16)
model, out, cache = sys.argv[1:4]
for n, change in enumerate(sys.argv[4:]):
    if change != "-":
        area, version = change.split("=")
        ALGORITHM_VERSIONS[area] = int(version)
    plan = run_study(s, model, f"{out}{n}", cache, plan_only=True)["plan"]
    print("PLAN", plan["cached"], sum(plan["runs"].values()))
    calls = []
    run_study(s, model, f"{out}{n}", cache, executor=fake_executor(calls))
    print("COMPUTED", sorted(calls))
"""


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return save_tiny_model("llama", str(tmp_path_factory.mktemp("id") / "m"), 4)


def _copy_packages(root: Path) -> Path:
    """Both packages copied under ``root`` (edited by the test, never the repo's)."""
    ignore = shutil.ignore_patterns("__pycache__")
    shutil.copytree(PLUGIN, root / "adadsf_modifier", ignore=ignore)
    shutil.copytree(LAB, root / "adadsf_lab", ignore=ignore)
    return root


def _studies(
    code: Path, model: str, tmp: Path, *changes: str
) -> list[tuple[tuple[int, int], list[str]]]:
    """Per study: ``((runs --plan found cached, runs planned), runs computed)``."""
    paths = [code, TESTS, TESTS.parents[1] / "tests"]  # + tiny_models
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(map(str, paths)))
    done = subprocess.run(
        [sys.executable, "-c", STUDY, model, str(tmp / "out"), str(tmp / "cache"),
         *changes],
        env=env, cwd=code, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [x for x in done.stdout.splitlines() if x.startswith("COMPUTED")]
    plans = [x.split()[1:] for x in done.stdout.splitlines() if x.startswith("PLAN")]
    computed = [
        json.loads(x.removeprefix("COMPUTED ").replace("'", '"')) for x in lines
    ]
    return [((int(a), int(b)), c) for (a, b), c in zip(plans, computed, strict=True)]


def test_edits_keep_cached_runs_and_a_version_bump_recomputes_its_runs(
    tiny_dir, tmp_path
):
    # the runs, computed here with the repository's code
    namespace: dict = {}
    exec(STUDY.split("model, out, cache")[0], namespace)
    first: list[str] = []
    run_study, fake_executor = namespace["run_study"], namespace["fake_executor"]
    run_study(namespace["s"], tiny_dir, tmp_path / "out", tmp_path / "cache",
              executor=fake_executor(first))  # fmt: skip
    assert sorted(first) == ["main:dense@1/seed0", "main:ftp@0.8/seed0",
                             "main:uniform@0.8/seed0"]  # fmt: skip
    # a copy with its presentation and command line edited, in a new process (which
    # reads the edited source): its keys are the same
    code = _copy_packages(tmp_path / "code")
    for rel in ("adadsf_lab/study/render.py", "adadsf_modifier/cli/__init__.py"):
        with (code / rel).open("a") as f:
            f.write("\n# an edit that changes no number\n")
    (plan, edited), (_, ftp_bumped), (_, routing_bumped) = _studies(
        code,
        tiny_dir,
        tmp_path,
        "-",
        f"ftp={ALGORITHM_VERSIONS['ftp'] + 1}",
        f"routing={ALGORITHM_VERSIONS['routing'] + 1}",
    )
    assert edited == []  # every run reused
    assert plan == (3, 3)  # and `--plan` said so before it ran: 3 of 3 cached
    # FTP's code changed its numbers and its version was bumped: only FTP recomputes
    assert ftp_bumped == ["main:ftp@0.8/seed0"]
    # the routed forward changed: every routed run recomputes, dense does not
    assert routing_bumped == ["main:ftp@0.8/seed0", "main:uniform@0.8/seed0"]


def test_each_method_is_keyed_by_the_areas_it_exercises():
    assert METHODS["dense"].algorithm_areas == ("evaluation",)
    assert METHODS["dense_lm"].algorithm_areas == ("alignment", "evaluation")
    assert METHODS["layer_drop"].algorithm_areas == ("adadsf", "evaluation", "routing")
    assert "alignment" in METHODS["adadsf"].algorithm_areas
    assert "ftp" in METHODS["ftp"].algorithm_areas
    assert "adadsf" not in METHODS["ftp"].algorithm_areas
    for method in METHODS.values():
        assert set(method.algorithm_areas) <= set(ALGORITHM_VERSIONS), method.name


# ------------------------------------------------------------------------------------
# a recorded tiny run, recomputed

RECORDED = TESTS / "data" / "tiny_run.json"
COMPARED = ("ppl_test", "ppl_val", "normalized_flops", "retention_ratios")


def _tiny_spec(model: str):
    s = StudySettings(methods=("adadsf",), budgets=(0.6,), seeds=1,
                      tune=False, calib_samples=4, calib_seq_len=32, align_steps=2,
                      align_batch_size=2, align_seq_len=32, router_hidden_size=4,
                      router_init_steps=5, router_init_tokens=64, tasks=(),
                      speed=False, ppl_tokens=128, ppl_val_tokens=96,
                      ppl_max_length=64, ppl_stride=32, flops_seq_len=32)  # fmt: skip
    ctx = Context("tiny llama", model_fingerprint(model), code_versions(), "cpu")
    tuned = Tuned.from_settings(s, "settings (tuning off)")
    (spec,) = [x for x in main_specs(s, ctx, tuned, None) if x.method != "dense"]
    return spec


def _host_class() -> str:
    """The CPU family a recording holds for: the vendor (MKL and oneDNN take different
    kernels on Intel and AMD) and the instruction set torch dispatches to. A tiny run's
    two alignment steps and threshold edges amplify last-bit differences between
    them, so one family's numbers cannot check another's."""
    import torch

    vendor = "unknown"
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        found = re.search(r"^vendor_id\s*:\s*(\S+)", cpuinfo.read_text(), re.M)
        vendor = found.group(1) if found else vendor
    return f"{vendor}/{torch.backends.cpu.get_cpu_capability()}"


@pytest.mark.usefixtures("single_thread")
def test_a_tiny_run_recomputes_to_its_recorded_numbers(tmp_path):
    """Fails when the plug-in's numbers move while ``ALGORITHM_VERSIONS`` stay put (or
    the other way round): bump the area you changed, then re-record with
    ``ADADSF_RECORD_TINY_RUN=1 pytest lab/tests/test_run_identity.py`` on each CPU
    family the suite runs on (the recording keeps one set of numbers per family)."""
    from transformers import AutoTokenizer

    from adadsf_lab.study.measure import TokenStreams

    model = save_tiny_model("llama", str(tmp_path / "m"), 4)
    spec = _tiny_spec(model)
    tok = AutoTokenizer.from_pretrained(model)
    record = execute_run(spec, RunEnv(model, "cpu", tok, TokenStreams(tok)))
    numbers = {k: record[k] for k in COMPARED}
    algorithm = spec.config["versions"]["algorithm"]
    host = _host_class()
    recorded = json.loads(RECORDED.read_text()) if RECORDED.exists() else {}
    if os.environ.get("ADADSF_RECORD_TINY_RUN") == "1":
        if recorded.get("algorithm") != algorithm:
            recorded = {"algorithm": algorithm, "hosts": {}}  # older numbers are void
        recorded["hosts"][host] = numbers
        RECORDED.parent.mkdir(exist_ok=True)
        RECORDED.write_text(json.dumps(recorded, indent=1) + "\n")
    assert recorded.get("algorithm") == algorithm, (
        "ALGORITHM_VERSIONS changed since the tiny run was recorded: re-record it"
    )
    if host not in recorded["hosts"]:
        pytest.skip(f"no tiny run recorded on a {host} CPU: record it there")
    for key, value in recorded["hosts"][host].items():
        assert numbers[key] == pytest.approx(value, rel=1e-4, abs=1e-6), (
            f"{key} moved with no ALGORITHM_VERSIONS bump: bump the area whose code "
            "changed the numbers, then re-record"
        )


def test_rendering_finds_a_run_computed_before_a_version_bump(tmp_path):
    from adadsf_lab.study.run_cache import OLDER_ALGORITHM, RunCache
    from adadsf_lab.study.spec import RunSpec

    def spec(routing: int) -> RunSpec:
        versions = {"torch": "2", "algorithm": {"routing": routing}}
        config = {"versions": versions, "modifier": {"retention": 0.8}}
        return RunSpec.create("main", "uniform", 0.8, 0, config)

    cache = RunCache(tmp_path)
    cache.put(spec(1), {"ppl_test": 30.0})
    assert cache.get(spec(2)) is None  # a study recomputes it
    # render-only shows it, saying which older version computed it
    assert cache.get(spec(2), lenient=True) == {
        "ppl_test": 30.0,
        OLDER_ALGORITHM: {"routing": 1},
    }
    assert cache.get(spec(1), lenient=True) == {"ppl_test": 30.0}  # an exact match


def test_results_say_how_many_runs_an_older_plugin_computed():
    from adadsf_lab.study.render import _older_code
    from adadsf_lab.study.run_cache import OLDER_ALGORITHM
    from adadsf_lab.study.study import _older_algorithm

    now = ALGORITHM_VERSIONS["adadsf"]
    records = [
        {"ppl_test": 1.0},
        {"ppl_test": 2.0, OLDER_ALGORITHM: {"adadsf": now - 1, "routing": 1}},
        {"ppl_test": 3.0, OLDER_ALGORITHM: {"adadsf": now - 2}},
        None,
    ]
    older = _older_algorithm(records)
    assert older["runs"] == 2
    assert older["areas"] == {"adadsf": [now - 2, now - 1], "routing": [1]}
    (line,) = _older_code({"older_algorithm": older})
    assert "2 of the runs shown were computed by an older plug-in" in line
    assert f"adadsf {now - 2}/{now - 1} (now {now})" in line
    assert _older_algorithm(records[:1]) == {} and _older_code({}) == []


def _run(method, budget, seed, older=False):
    from adadsf_lab.study.run_cache import OLDER_ALGORITHM

    record = {"method": method, "budget": budget, "seed": seed, "ppl_test": 1.0}
    return {**record, OLDER_ALGORITHM: {"routing": 1}} if older else record


def test_a_run_of_this_plugin_leaves_out_the_older_runs_of_its_cell_only():
    from adadsf_lab.study.study import current_supersedes_older

    runs = [
        _run("uniform", 0.8, 0),
        _run("uniform", 0.8, 1, older=True),
        _run("uniform", 0.7, 1, older=True),  # no current run at 0.7: kept
        _run("adadsf", 0.8, 0, older=True),  # no current run of adadsf: kept
        _run("adadsf", 0.8, 1, older=True),
    ]
    kept, left_out = current_supersedes_older(runs)
    assert kept == [runs[0], *runs[2:]]
    assert left_out == [{"method": "uniform", "budget": 0.8, "seed": 1}]


def test_the_header_counts_the_headline_runs_by_the_code_that_computed_them():
    from adadsf_lab.study.aggregate import _headline
    from adadsf_lab.study.render import _headline_and_left_out

    results = {
        "settings": {"tune_budget": 0.8},
        "summary": [
            {"method": "adadsf_ridge_kv_err", "budget": b, "seeds": s}
            for b, s in ((0.8, [0]), (0.7, [0, 1, 2]))
        ],
        "dense": _run("dense", 1.0, 0),
        "runs": [
            _run("adadsf_ridge_kv_err", 0.8, 0),
            _run("adadsf_ridge_kv_err", 0.7, 0, older=True),  # another budget
            _run("adadsf", 0.8, 0, older=True),
            _run("adadsf", 0.8, 1, older=True),
            _run("ftp", 0.8, 0, older=True),  # not behind the table or its verdicts
        ],
    }
    h = _headline(results)
    assert h == {
        "budget": 0.8,  # the tuning budget, though 0.7 has more seeds
        "current": {"dense": 1, "adadsf_ridge_kv_err": 1},
        "older": {"adadsf": 2},
    }
    left = [{"method": "uniform", "budget": 0.8, "seed": s} for s in (2, 1)]
    head, tail = _headline_and_left_out({"headline": h, "superseded": left})
    assert "verdicts at 0.8: 2 of 4 computed by an older plug-in" in head
    assert "older: adadsf 2" in head
    assert tail.endswith("uniform at 0.8 seeds 1, 2")
    assert _headline_and_left_out({}) == []


def test_a_verdict_pairs_only_seeds_one_plugin_computed_for_both_methods():
    from adadsf_lab.study.aggregate import _comparisons

    def runs(method, ppls, older_seeds=()):
        return [
            {**_run(method, 0.8, s, older=s in older_seeds), "ppl_test": p}
            for s, p in enumerate(ppls)
        ]

    # seed 0 of uniform was recomputed; seeds 1 and 2 pair older runs with older runs
    rows, sentences = _comparisons(
        runs("adadsf", [10.0, 11.0, 12.0], older_seeds=(0, 1, 2))
        + runs("uniform", [99.0, 13.0, 15.0], older_seeds=(1, 2))
    )
    (ppl,) = [r for r in rows if r["metric"] == "ppl_test"]
    assert tuple(ppl["seeds"]) == (1, 2) and ppl["mean_diff"] == -2.5
    # no seed in common by the same code: said, not computed
    rows, sentences = _comparisons(
        runs("adadsf", [10.0], older_seeds=(0,)) + runs("uniform", [99.0])
    )
    assert rows == []
    assert sentences == [
        "AdaDSF (similarity) vs uniform (MoD) at 0.8: no seed has runs of both "
        "computed by the same plug-in, no comparison"
    ]
