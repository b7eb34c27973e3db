"""FTP's sparsity scheduler: a seeded genetic search over per-layer ratios.

Every candidate is projected onto the budget (``clip_to_budget``), so the budget holds
by construction, not by penalty. Fitness: the next-token loss of the model routed by
the static router, on batches held out from everything the router trains or calibrates
on (the paper tuned on its benchmark). Evaluations are memoised.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from loguru import logger
from torch import nn
from tqdm.auto import tqdm

from adadsf_modifier.fitting.allocation import clip_to_budget
from adadsf_modifier.utils import MODEL_INPUT_KEYS, model_device, tensors_to_device


@dataclass
class ScheduleResult:
    ratios: list[float]
    loss: float
    uniform_loss: float
    evaluations: int
    best_per_generation: list[float] = field(default_factory=list)


def _project(raw: Sequence[float], retention: float, low: float) -> list[float]:
    return clip_to_budget([max(r, 1e-6) for r in raw], retention, low)


def genetic_schedule(
    evaluate: Callable[[list[float]], float],
    num_layers: int,
    retention: float,
    min_retention: float,
    population: int = 8,
    generations: int = 4,
    mutation: float = 0.25,
    seed: int = 0,
    elite: int = 2,
) -> ScheduleResult:
    """Minimise ``evaluate(ratios)`` over ratios of mean ``retention`` in
    ``[min_retention, 1]``: generation 0 is the uniform schedule and log-normal
    mutations of it; each next one keeps the ``elite`` best and adds mutated uniform
    crossovers of tournament winners."""
    if num_layers < 1:
        raise ValueError("the scheduler needs at least one routed layer")
    if population < 2 or generations < 0 or not 0 <= elite < population:
        raise ValueError(
            f"need population >= 2, generations >= 0 and 0 <= elite < population, got "
            f"{population}, {generations}, {elite}"
        )
    rng = random.Random(seed)
    cache: dict[tuple[float, ...], float] = {}

    def fitness(ratios: list[float]) -> float:
        key = tuple(round(r, 6) for r in ratios)
        if key not in cache:
            cache[key] = float(evaluate(list(key)))
        return cache[key]

    def mutate(ratios: list[float]) -> list[float]:
        raw = [r * math.exp(rng.gauss(0.0, mutation)) for r in ratios]
        return _project(raw, retention, min_retention)

    uniform = [retention] * num_layers
    pop = [uniform] + [mutate(uniform) for _ in range(population - 1)]
    logger.info(
        f"FTP scheduler: genetic search over {num_layers} layer ratios, population "
        f"{population} x {generations} generations (+ the initial one): at most "
        f"{population * (generations + 1)} candidate evaluations, seed {seed}"
    )
    history: list[float] = []
    for gen in tqdm(range(generations + 1), desc="FTP scheduler", leave=False):
        scored = sorted(pop, key=fitness)
        history.append(fitness(scored[0]))
        logger.debug(f"FTP scheduler generation {gen}: best loss {history[-1]:.5f}")
        if gen == generations:
            break

        def pick() -> list[float]:
            a, b = rng.sample(scored, 2)
            return a if fitness(a) <= fitness(b) else b

        nxt = [list(p) for p in scored[:elite]]
        while len(nxt) < population:
            pa, pb = pick(), pick()
            child = [a if rng.random() < 0.5 else b for a, b in zip(pa, pb)]
            nxt.append(mutate(_project(child, retention, min_retention)))
        pop = nxt
    best = min(pop, key=fitness)
    return ScheduleResult(
        ratios=list(best),
        loss=fitness(best),
        uniform_loss=fitness(uniform),
        evaluations=len(cache),
        best_per_generation=history,
    )


@torch.no_grad()
def validation_loss(model: nn.Module, batches: Sequence[dict]) -> float:
    """Mean next-token negative log-likelihood over the real targets of ``batches``
    (a target and the token before it both real)."""
    was_training = model.training
    model.eval()
    device = model_device(model)
    total, count = 0.0, 0
    try:
        for batch in batches:
            inputs = {k: v for k, v in batch.items() if k in MODEL_INPUT_KEYS}
            inputs = tensors_to_device(inputs, device)
            logits = model(**inputs, use_cache=False).logits[:, :-1].float()
            target = inputs["input_ids"][:, 1:]
            mask = inputs.get("attention_mask")
            nll = torch.nn.functional.cross_entropy(
                logits.reshape(-1, logits.shape[-1]),
                target.reshape(-1),
                reduction="none",
            ).view_as(target)
            if mask is not None:
                nll = nll[mask[:, 1:].bool() & mask[:, :-1].bool()]
            total += float(nll.sum())
            count += nll.numel()
    finally:
        model.train(was_training)
    if count == 0:
        raise ValueError("the validation batches hold no next-token targets")
    return total / count
