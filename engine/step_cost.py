"""What a step costs: a model of its time that the engine fits to its own measured steps, and the chunks of a
long prompt it allows (engine/scheduler.py sizes them to the step's time budget).

A step's time grows with what it computes (engine/step.py's StepWork): its tokens (the linear layers' rows),
the keys its rows read (each row reads its sequence's keys and values in every layer) and the (query, key)
pairs its tokens attend to (a token at position p attends to p + 1 keys, so a chunk at position 15k costs
several times one at 0). The model is linear in those three, plus a fixed cost (launches, the host's work,
reading the weights):

    seconds = fixed + per_token * tokens + per_key * keys + per_attended * attended

It is fitted by non-negative least squares to the steps the engine measured last, kept by kind (bins of a
step's tokens and mean context), so that a long run of decode steps does not push out what the prefill
steps taught; each device, model and load thus gets its own fit. It predicts nothing before it has measured
steps of two sizes.
"""

from __future__ import annotations

import collections
import itertools
import math

import numpy
from tileinfer.engine.step import StepWork

# The steps kept per bin of (tokens, mean context), each bin a power of two of each: the latest ones.
SAMPLES_PER_BIN = 4
# A step measured above this many times its prediction counts as this many (a kernel compiled in it, or
# the host was descheduled): one outlier must not undo the fit.
MAX_SURPRISE = 3.0
# Feature scales, so that the normal equations stay well conditioned in float64.
_SCALES = numpy.array([1.0, 1e-3, 1e-5, 1e-7])
# The supports a non-negative least-squares solution can have: every non-empty set of the four terms,
# the whole set first.
_SUPPORTS = [
    list(support) for size in range(4, 0, -1) for support in itertools.combinations(range(4), size)
]  # fmt: skip


def _features(work: StepWork) -> tuple[float, int, int, int]:
    return (1.0, work.tokens, work.keys, work.attended)


def _non_negative_least_squares(features: numpy.ndarray, seconds: numpy.ndarray) -> numpy.ndarray:
    """The coefficients >= 0 that fit seconds ~ features @ coefficients best: the least-squares solution
    when none of them is negative (the usual case), else, with four terms, the best of the least-squares
    solutions on each support whose coefficients are all non-negative."""
    gram, moment, square = features.T @ features, features.T @ seconds, float(seconds @ seconds)
    best, best_error = numpy.zeros(4), square
    for support in _SUPPORTS:
        sub = gram[numpy.ix_(support, support)]
        try:
            solution = numpy.linalg.solve(sub + 1e-9 * numpy.eye(len(support)), moment[support])
        except numpy.linalg.LinAlgError:
            continue
        if (solution < 0).any():
            continue
        if len(support) == 4:
            return solution  # the unconstrained optimum is feasible: it is the optimum
        error = square - 2 * solution @ moment[support] + solution @ sub @ solution
        if error < best_error:
            best, best_error = numpy.zeros(4), error
            best[support] = solution
    return best


class StepCostModel:
    """The engine's model of its own step times: observe each measured step, predict a step's seconds, and
    size a long prompt's chunk from them (largest_chunk, efficient_chunk)."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        """Forget every measurement (warm-up's steps compile kernels: they say nothing of serving)."""
        # the latest steps per bin of (tokens, mean context): (their work, seconds)
        self._recent: dict[tuple[int, int], collections.deque[tuple[StepWork, float]]] = {}
        self._coefficients: numpy.ndarray | None = None  # raw units: seconds per unit of each term
        self._stale = False
        self._largest = StepWork()  # the most of each term any step measured had

    @property
    def largest_tokens(self) -> int:
        """The most tokens of any step measured (the scheduler's slow start)."""
        return self._largest.tokens

    def observe(self, work: StepWork, seconds: float) -> None:
        """Take a measured step: its work and the seconds it took. Cheap (the engine calls it every step):
        the fit waits until a prediction is asked for."""
        largest = self._largest
        if work.tokens <= largest.tokens and work.keys <= largest.keys and work.attended <= largest.attended:
            # within what was measured (beyond it a step teaches something new), the last fit, stale or
            # not, is enough to spot an outlier; refitting for each step would cost more
            coefficients = self._coefficients if self._coefficients is not None else self.coefficients()
            if coefficients is not None:
                seconds = min(seconds, MAX_SURPRISE * self._predict(coefficients, work))
        mean_context = work.attended // max(work.tokens, 1)
        key = (work.tokens.bit_length(), mean_context.bit_length())
        recent = self._recent.get(key)
        if recent is None:
            recent = self._recent[key] = collections.deque(maxlen=SAMPLES_PER_BIN)
        recent.append((work, seconds))
        self._largest = StepWork(
            max(largest.tokens, work.tokens),
            max(largest.keys, work.keys),
            max(largest.attended, work.attended),
        )
        self._stale = True

    def coefficients(self) -> numpy.ndarray | None:
        """(fixed, per_token, per_key, per_attended) in seconds, or None before steps of two sizes."""
        if self._stale:
            self._stale = False
            if len({tokens_bin for tokens_bin, _ in self._recent}) >= 2:
                samples = [sample for recent in self._recent.values() for sample in recent]
                features = numpy.array([_features(work) for work, _ in samples]) * _SCALES
                seconds = numpy.array([seconds for _, seconds in samples])
                self._coefficients = _non_negative_least_squares(features, seconds) * _SCALES
        return self._coefficients

    @staticmethod
    def _predict(coefficients: numpy.ndarray, work: StepWork) -> float:
        fixed, per_token, per_key, per_attended = coefficients.tolist()
        return fixed + per_token * work.tokens + per_key * work.keys + per_attended * work.attended

    def predict(self, work: StepWork) -> float | None:
        """The step's predicted seconds, or None when the model has no fit yet."""
        coefficients = self.coefficients()
        return None if coefficients is None else self._predict(coefficients, work)

    def _chunk_cost(self, context: int) -> tuple[float, float, float] | None:
        """A chunk of x tokens after `context` computed ones adds base + linear * x + quadratic * x**2."""
        coefficients = self.coefficients()
        if coefficients is None:
            return None
        _, per_token, per_key, per_attended = coefficients
        linear = per_token + per_key + per_attended * (context + 0.5)
        return per_key * context, linear, per_attended / 2

    def largest_chunk(self, work: StepWork, context: int, budget_s: float) -> int | None:
        """The most tokens a prompt's chunk after `context` computed ones may add to a step that computes
        `work` besides it, with the step predicted to end within budget_s (0 if it cannot); None when the
        model has no fit yet."""
        predicted, chunk = self.predict(work), self._chunk_cost(context)
        if predicted is None or chunk is None:
            return None
        base, linear, quadratic = chunk
        return int(min(_root(quadratic, linear, predicted + base - budget_s), 1 << 62))

    def efficient_chunk(self, context: int) -> int:
        """The fewest tokens of a chunk after `context` computed ones that cost at least what their step
        and their row cost anyway (the fixed cost, and reading the row's keys): a long prompt's chunk is
        never smaller, so that it runs at half its best speed or more. 0 when the model has no fit yet."""
        coefficients, chunk = self.coefficients(), self._chunk_cost(context)
        if coefficients is None or chunk is None:
            return 0
        base, linear, quadratic = chunk
        root = _root(quadratic, linear, -(coefficients[0] + base))
        return math.ceil(root) if math.isfinite(root) else 0


def _root(quadratic: float, linear: float, constant: float) -> float:
    """The largest x >= 0 with quadratic * x**2 + linear * x + constant <= 0, for non-negative quadratic
    and linear: 0 when even x = 0 exceeds it, inf when nothing grows with x."""
    if constant > 0:
        return 0.0
    if quadratic <= 0 and linear <= 0:
        return math.inf
    if quadratic <= 0:
        return -constant / linear
    return (-linear + math.sqrt(linear * linear - 4 * quadratic * constant)) / (2 * quadratic)
