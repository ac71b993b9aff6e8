"""Tasks: where prompts, answers and rewards come from, one registry (``TASKS``) of factories
``(tokenizer, seed, **hyperparams) -> task``.

A task has ``sample(k, step)``, ``held_out(k)``, ``encode(sample) -> ids`` (a string prompt as
is, chat messages through the tokenizer's chat template), ``rewards`` (named
reward functions ``(response, sample) -> float``; several fill ``reward_components`` ``[B, K]``),
``state()`` / ``load_state()`` (its data cursor, for resume) and ``limits()`` (the token lengths its data needs:
:class:`TaskLimits`).

``arith`` (the embedded default, generated in code): ``"17+38="`` → ``"55"`` + EOS, two-digit
operands ``0..49`` written at a fixed width, 250 operand pairs held out for evaluation; reward: the
dense per-place :func:`~hyperrl.rewards.builtin.digit_match` plus exact match.
``products`` (the tool-use task, with the ``calculator_copy`` environment): ``"347*28="`` →
``"09716"``, products a tiny model cannot compute in its head.
``modsum`` (the first default): prompt ``"a+b="`` with digits ``a, b``; the answer is
``(a + b) mod m``, one token; reward 1 when the first generated character is the answer digit.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from hyperrl.data import DataError, PromptDataset, PromptLoader, Sample, render_chat
from hyperrl.data.incode import InCodeTask, TaskLimits, held_out_split
from hyperrl.multimodal import IMAGE_TEXT, expand_placeholders, image_token_id
from hyperrl.registry import Registry
from hyperrl.rewards.builtin import REWARDS, RewardName
from hyperrl.tokenizer import encode_prompt

__all__ = ["TASKS", "register_task", "TaskCapabilities", "TaskLimits", "ModSumTask", "ArithTask", "RepeatTask",
           "arith_problems", "FileTask", "ParquetTask", "PreferenceTask", "make_task", "shapes"]


@dataclass(frozen=True)
class TaskCapabilities:
    """What a task factory does beyond prompts and rewards — declared where it registers
    (``register_task(name, capabilities=TaskCapabilities(...))``), never probed: ``takes_images`` — it is called
    ``(tokenizer, seed, image_processor)`` with the model's image processor (None for a text model), and built
    with one its samples carry images (``task.vision(sample)``); ``needs_images`` — a text model is refused at
    load; ``pairs`` — its samples are preference pairs (prompt, chosen, rejected), which only a preference loss
    (``algo.preference``) trains on."""

    takes_images: bool = False
    needs_images: bool = False
    pairs: bool = False


TASKS: Registry = Registry("task", capabilities=TaskCapabilities())
register_task = TASKS.register


def _reward_fns(names, where: str) -> tuple:
    if isinstance(names, str):
        names = (names,)
    if not names:
        raise ValueError(f"{where}: a task needs at least one reward")
    return tuple((n, REWARDS.get(n)) for n in names)


@dataclass
class ModSumTask(InCodeTask):
    """The ``modsum`` task, generated in code: prompt ``"a+b="`` with ``a, b`` in ``0..max_operand``, answer
    ``str((a + b) % modulus)``; reward ``first_char_exact`` by default. ``held_out`` draws from a fixed stream."""

    tokenizer: object
    modulus: int = 10
    max_operand: int = 9
    seed: int = 0
    rewards: tuple = field(default_factory=lambda: _reward_fns(("first_char_exact",), "task.rewards"))

    def _draw(self, k: int, stream: int, attempt: int = 0) -> list[Sample]:
        ab = self._rng(stream, attempt).integers(0, self.max_operand + 1, size=(k, 2))
        return [Sample(f"{a}+{b}=", str((a + b) % self.modulus), f"modsum:{a}+{b}", {}) for a, b in ab.tolist()]

    def sample(self, k: int, step: int, attempt: int = 0) -> list[Sample]:
        """``k`` prompts for ``step`` — a pure function of (seed, step, attempt), so resumed runs see
        the same data; ``attempt`` > 0 draws fresh prompts for a refill round."""
        return self._draw(k, step, attempt)

    def held_out(self, k: int) -> list[Sample]:
        return self._draw(k, 10**9)


def arith_problems(ops: str, lo: int, hi: int, lo2: int | None = None, hi2: int | None = None
                   ) -> list[tuple[int, str, int, int]]:
    """Every ``(a, op, b, answer)`` with ``a`` in ``lo..hi`` and ``b`` in ``lo2..hi2`` (default: the same
    range), in a fixed order; ``op`` in ``+ - *`` (``-`` only for ``a ≥ b``: answers are never negative)."""
    lo2, hi2 = lo if lo2 is None else lo2, hi if hi2 is None else hi2
    fns = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}
    return [(a, op, b, fns[op](a, b)) for op in ops for a in range(lo, hi + 1) for b in range(lo2, hi2 + 1)
            if op != "-" or a >= b]


@dataclass
class ArithTask(InCodeTask):
    """Two-operand addition / subtraction (``arith``) or multiplication (``products``), generated in
    code: prompt ``"37+48="``, answer ``"85"`` (the policy must end it with EOS); ``pad``: operands
    and answers zero-padded to a fixed width (``"07+12="`` → ``"19"``, ``"01+04="`` → ``"05"``: a
    digit's place is its position), else as is (answers of 1–3 digits). ``held_out`` problems — a
    fixed fraction of all ``(a, op, b)``, drawn with ``split_seed`` (the same for every run seed, so
    runs compare on one held-out set) — are never trained on."""

    tokenizer: object
    ops: str = "+"
    min_operand: int = 0
    max_operand: int = 49
    held_out_frac: float = 0.1
    split_seed: int = 0
    pad: bool = True
    seed: int = 0
    rewards: tuple = field(default_factory=lambda: _reward_fns(("digit_match", "exact_answer"), "task.rewards"))
    second: tuple[int, int] | None = None  # the second operand's range (default: the first's)

    def __post_init__(self):
        lo2, hi2 = self.second or (self.min_operand, self.max_operand)
        problems = arith_problems(self.ops, self.min_operand, self.max_operand, lo2, hi2)
        self._width = len(str(self.max_operand)) if self.pad else 0
        self._width2 = len(str(hi2)) if self.pad else 0
        self._answer_width = max(len(str(p[3])) for p in problems) if self.pad else 0
        self._train, self._eval = held_out_split(problems, self.held_out_frac, self.split_seed, 7)

    @property
    def response_tokens(self) -> int:
        """The response budget an exact answer needs: the longest answer's digits + EOS."""
        return max(len(str(p[3])) for p in self._train + self._eval) + 1

    def _sample(self, p: tuple[int, str, int, int]) -> Sample:
        a, op, b, ans = p
        expression = f"{a}{op}{b}"  # unpadded: what a calculator parses ("07" is not a Python literal)
        return Sample(f"{a:0{self._width}d}{op}{b:0{self._width2}d}=", f"{ans:0{self._answer_width}d}",
                      f"arith:{expression}", {"expression": expression})

    def sample(self, k: int, step: int, attempt: int = 0) -> list[Sample]:
        """``k`` training problems for ``step``, uniformly with replacement — a pure function of
        (seed, step, attempt), so resumed runs see the same data."""
        idx = self._rng(step, attempt).integers(0, len(self._train), size=k)
        return [self._sample(self._train[i]) for i in idx.tolist()]

    def held_out(self, k: int) -> list[Sample]:
        """The first ``k`` held-out problems (all of them when fewer)."""
        return [self._sample(p) for p in self._eval[:k]]


@dataclass
class RepeatTask(InCodeTask):
    """A variable-length answer with a long tail, generated in code: prompt ``"7*3="``, answer
    ``"777"`` (the digit ``k`` times, then EOS). ``k`` is short (``1..short_max``) for most prompts and
    ``tail_min..tail_max`` — 4–8× longer — for a ``tail_frac`` of them, like reasoning traces: most
    short, a tail of long ones (the generation-heavy shape asynchronous RL is for). A fixed
    ``held_out_frac`` of the (digit, k) pairs is held out; the tail keeps its share there."""

    tokenizer: object
    short_max: int = 3
    tail_min: int = 12
    tail_max: int = 20
    tail_frac: float = 0.2
    held_out_frac: float = 0.15
    split_seed: int = 0
    seed: int = 0
    rewards: tuple = field(default_factory=lambda: _reward_fns(("digit_credit", "exact_answer"), "task.rewards"))

    def __post_init__(self):
        pairs = [(d, k) for d in range(10) for k in [*range(1, self.short_max + 1),
                                                     *range(self.tail_min, self.tail_max + 1)]]
        train, held = held_out_split(pairs, self.held_out_frac, self.split_seed, 11)
        held = set(held)
        self._eval = [p for p in pairs if p in held]
        self._short = [p for p in train if p[1] <= self.short_max]
        self._tail = [p for p in train if p[1] > self.short_max]

    @property
    def response_tokens(self) -> int:
        return self.tail_max + 1

    @staticmethod
    def _sample(p: tuple[int, int]) -> Sample:
        d, k = p
        return Sample(f"{d}*{k}=", str(d) * k, f"repeat:{d}*{k}", {})

    def sample(self, k: int, step: int, attempt: int = 0) -> list[Sample]:
        """``k`` prompts for ``step``: each from the tail with probability ``tail_frac`` — a pure
        function of (seed, step, attempt)."""
        rng = self._rng(step, attempt)
        tail = rng.random(k) < self.tail_frac
        return [self._sample(pool[int(rng.integers(0, len(pool)))]) for pool in
                (self._tail if t else self._short for t in tail.tolist())]

    def held_out(self, k: int) -> list[Sample]:
        return [self._sample(p) for p in self._eval[:k]]


@dataclass
class PostfixTask(InCodeTask):
    """A code task that only running the answer can judge, generated in code: the prompt is a linear function
    ``a·x + b`` in postfix notation — ``"x3*1+="`` (``3·x + 1``), ``"x3*1-="`` (``3·x − 1``), ``"x3*="`` (``3·x``);
    ``a`` in ``1..max_digit``, ``b`` in ``−max_digit..max_digit`` — and the answer a Python expression of ``x``
    computing it: ``"3*x+1"``, ``"x*3+1"``, ``"1+3*x"``, ``"x+x+x+1"`` are all right. Each sample carries its
    ``tests`` (:meth:`tests` at ``xs``: increasing, then within 10×, 2×, 10 %, exact at each — the reward climbs
    from ``x`` to ``x*5`` to ``x*3`` to ``x*3+1``, and a constant passes at most one of the 13) and
    ``prefix`` ``"f = lambda x: "`` (the program the code reward runs is the prefix and the answer). The reference
    answer (``answer``: ``"3*x+1"``) is one correct program among many; a fixed ``held_out_frac`` of the functions
    is held out."""

    tokenizer: object
    max_digit: int = 9
    held_out_frac: float = 0.15
    split_seed: int = 0
    seed: int = 0
    rewards: tuple = field(default_factory=lambda: _reward_fns(("program_passes",), "task.rewards"))
    xs: tuple[int, ...] = (10, 10_000, 10_000_000)  # far apart: a constant is within 10× of one at most
    prefix = "f = lambda x: "

    def __post_init__(self):
        problems = [(a, b) for a in range(1, self.max_digit + 1) for b in range(-self.max_digit, self.max_digit + 1)]
        self._train, self._eval = held_out_split(problems, self.held_out_frac, self.split_seed, 13)

    @property
    def response_tokens(self) -> int:
        return len("9*x+9") + 1

    @staticmethod
    def tests(f, xs) -> list[str]:
        """The graded asserts for the increasing function ``f`` at ``xs`` (each ``f(x) > 0``): the program
        increases over ``xs`` (a constant does not), then at each ``x`` within a factor of 10, within a factor of 2,
        within 10 %, exact — the pass fraction rises as the program nears ``f``."""
        out = [f"assert {' < '.join(f'f({x})' for x in xs)}"]
        for x in xs:
            t = f(x)
            out += [f"assert {t} / 10 <= f({x}) <= {t} * 10", f"assert {t} / 2 <= f({x}) <= {t} * 2",
                    f"assert abs(f({x}) - {t}) <= {t} / 10", f"assert f({x}) == {t}"]
        return out

    def _sample(self, p: tuple[int, int]) -> Sample:
        a, b = p
        tests = self.tests(lambda x: a * x + b, self.xs)
        rpn = f"x{a}*" + (f"{b}+" if b > 0 else f"{-b}-" if b < 0 else "")
        answer = f"{a}*x" + (f"{b:+d}" if b else "")
        return Sample(f"{rpn}=", answer, f"postfix:{rpn}", {"tests": tests, "prefix": self.prefix})

    def sample(self, k: int, step: int, attempt: int = 0) -> list[Sample]:
        """``k`` training functions for ``step``, uniformly with replacement (a pure function of seed, step,
        attempt)."""
        idx = self._rng(step, attempt).integers(0, len(self._train), size=k)
        return [self._sample(self._train[i]) for i in idx.tolist()]

    def held_out(self, k: int) -> list[Sample]:
        return [self._sample(p) for p in self._eval[:k]]


class FileTask:
    """Prompts from data files (parquet / JSONL / JSON) or Python records / an HF ``datasets.Dataset``
    (resumable shuffled cursor), validation prompts from their own files, rewards from ``REWARDS``.

    ``max_prompt_length`` > 0 tokenises every prompt once at construction: over-long ones are an
    ``error`` (naming the file, row and length — before anything is trained or written),
    ``filter``-ed out (counted: ``filtered``), or ``truncate``-d to their last tokens (the end of a
    chat prompt holds the generation prompt)."""

    def __init__(self, tokenizer, train, val=None, rewards=("gsm8k_exact",), *, seed: int = 0,
                 prompt_key: str = "prompt", max_prompt_length: int = 0, overlong_prompts: str = "error",
                 apply_chat_template: str = "auto"):
        if overlong_prompts not in ("error", "filter", "truncate"):
            raise ValueError(f"overlong_prompts={overlong_prompts!r}: choose error | filter | truncate")
        if apply_chat_template not in ("auto", "always", "never"):
            raise ValueError(f"data.apply_chat_template={apply_chat_template!r}: choose auto | always | never")
        self.tokenizer, self.rewards = tokenizer, _reward_fns(rewards, "task.rewards")
        self.max_len, self.overlong, self._ids, self.filtered = max_prompt_length, overlong_prompts, {}, 0
        self.chat, self.longest_prompt = apply_chat_template, 0
        self.dataset = self._bounded(self._read(train, prompt_key), "train")
        self.val = self._bounded(self._read(val, prompt_key), "val") if val else None
        self.loader = PromptLoader(self.dataset, 1, seed=seed)
        self._warn_plain_prompts()

    def limits(self) -> TaskLimits:
        """Its longest prompt, as encoded (measured with ``max_prompt_length`` > 0, else 0)."""
        return TaskLimits(longest_prompt=self.longest_prompt)

    def _read(self, src, prompt_key: str) -> PromptDataset:
        """The rows of ``src``; a row carrying images (an ``images`` / ``image`` column) is an error here: this
        task feeds a text model."""
        ds = _dataset(src, prompt_key)
        for s in ds.samples:
            for key in ("images", "image"):
                if s.extra.get(key) is not None and s.extra.get(key) != []:
                    raise DataError(f"{s.source}: column {key!r} holds images but the model is text-only; train a "
                                    "vision-language model (model.vision, or a Qwen-VL model.checkpoint), or drop "
                                    "the column")
        return ds

    def _warn_plain_prompts(self) -> None:
        """``auto`` with plain-string prompts and a tokenizer that has a chat template: said once —
        the model sees the raw text, without the template it was tuned on."""
        if self.chat != "auto" or not getattr(self.tokenizer, "chat_template", None):
            return
        first = next((s for s in self.dataset.samples if isinstance(s.prompt, str)), None)
        if first is not None:
            import warnings

            warnings.warn(f"{first.source}: the prompt is a plain string and the tokenizer has a chat template; it "
                          "is encoded as raw text, without the template. Set data.apply_chat_template=always to wrap "
                          "it as a user turn, or never to silence this", UserWarning, stacklevel=3)

    def _encode(self, prompt) -> list[int]:
        """``apply_chat_template``: auto — chat messages through the template, strings as is;
        always — a string is a user turn through the template; never — messages as plain ``role:
        content`` lines."""
        if self.chat == "always" and isinstance(prompt, str):
            prompt = [{"role": "user", "content": prompt}]
        elif self.chat == "never" and not isinstance(prompt, str):
            prompt = render_chat(prompt)
        return encode_prompt(self.tokenizer, prompt)

    def _bounded(self, ds: PromptDataset, which: str) -> PromptDataset:
        """Every prompt encoded once, here — one the tokenizer cannot encode is a :class:`DataError`
        naming its file and row before anything is trained — and held to ``max_prompt_length``."""
        keep = []
        for s in ds.samples:
            try:
                ids = self._encode(s.prompt)
            except Exception as e:  # noqa: BLE001 - the tokenizer's or its chat template's error, for this row
                raise DataError(f"{s.source}: the prompt cannot be encoded ({type(e).__name__}: {e}); fix the row, "
                                "or the tokenizer (model.tokenizer) and its chat template") from None
            n = self._length(s, ids)
            if self.max_len and n > self.max_len:
                if self.overlong == "error":
                    raise DataError(f"{s.source}: prompt of {n} tokens > data.max_prompt_length="
                                    f"{self.max_len} ({which}); raise it, or set data.overlong_prompts to filter or "
                                    "truncate")
                if self.overlong == "filter":
                    self.filtered += 1
                    continue
                ids, n = ids[-self.max_len:], self.max_len
            self._ids[s.source] = ids
            self.longest_prompt = max(self.longest_prompt, n)
            keep.append(s)
        return PromptDataset(keep, ds.skipped)

    def _length(self, sample: Sample, ids: list[int]) -> int:
        """The prompt's length as the engine sees it (what ``max_prompt_length`` and the context bound count)."""
        return len(ids)

    def sample(self, k: int, step: int, attempt: int = 0) -> list[Sample]:
        """The next ``k`` rows of the resumable cursor (refill rounds read on)."""
        return self.loader.next_batch(k)

    def held_out(self, k: int) -> list[Sample]:
        """The first ``k`` validation rows (all of them when fewer) — never training rows."""
        if self.val is None:
            raise DataError("evaluation needs validation data: set data.val_files (or task.val_files), or "
                            "run.eval_every=0")
        return self.val.samples[: min(k, len(self.val))]

    def encode(self, sample: Sample) -> list[int]:
        """The prompt's ids (``apply_chat_template``: see :meth:`_encode`)."""
        ids = self._ids.get(sample.source)
        return list(ids) if ids is not None else self._encode(sample.prompt)

    def reward(self, response: str, sample: Sample) -> float:
        return float(self.rewards[0][1](response, sample))

    def state(self) -> dict:
        from dataclasses import asdict

        return {"cursor": asdict(self.loader.state)}

    def load_state(self, state: dict) -> None:
        from hyperrl.data import CursorState

        if "cursor" in state:
            self.loader.state = CursorState(**state["cursor"])


ParquetTask = FileTask  # the earlier name


class VisionFileTask(FileTask):
    """:class:`FileTask` over multimodal rows — verl's format (``<image>`` in the prompt, an ``images`` column of
    ``{bytes, path}``) or TRL's (``{"type": "image"}`` parts, ``images`` / ``image``), read by
    :func:`hyperrl.data.images.vision_samples`, each image decoded once — for a vision-language model: a
    placeholder is written as the model's vision tokens (what the Qwen-VL chat template writes for an image) before
    the prompt is encoded, then expanded to its image's ``t·h·w / merge²`` placeholders; the images go through the
    model's ``image_processor`` (resized by its rules) when a row is drawn — the last :attr:`KEEP` rows' pixels are
    kept, not every row's (a dataset's pixels would not fit in memory). ``max_prompt_length`` and the context bound
    count a prompt with its images expanded (each image's grid from its size by the processor's own rule, at load);
    ``overlong_prompts: truncate`` is refused (a cut could split an image's placeholders)."""

    KEEP = 1024

    def __init__(self, tokenizer, image_processor, train, val=None, rewards=("gsm8k_exact",), *, image_key=None,
                 image_root=None, **kw):
        from collections import OrderedDict

        self.image_processor, self.image_key, self._images, self._vision = image_processor, image_key, {}, OrderedDict()
        self.image_root = image_root
        self.image_token_id = image_token_id(tokenizer, "data with images")
        if kw.get("max_prompt_length") and kw.get("overlong_prompts") == "truncate":
            raise ValueError("data.overlong_prompts=truncate with images: a cut could split an image's placeholders; "
                             "use error or filter")
        self.merge = int(getattr(image_processor, "merge_size", 2))
        super().__init__(tokenizer, train, val, rewards, **kw)

    def _length(self, sample: Sample, ids: list[int]) -> int:
        """``ids`` with each image's one placeholder counted as its ``patches / merge²`` (the processor's
        ``get_number_of_image_patches`` from the image's size: nothing is resized here)."""
        extra = 0
        for i, im in enumerate(self._images[sample.source]):
            try:
                patches = self.image_processor.get_number_of_image_patches(im.height, im.width, {})
            except ValueError as e:  # e.g. an aspect ratio the processor refuses
                raise DataError(f"{sample.source}: image {i} ({im.width}×{im.height}) is refused by the model's "
                                f"image processor: {e}") from None
            extra += patches // self.merge ** 2 - 1
        return len(ids) + extra

    def _read(self, src, prompt_key: str) -> PromptDataset:
        from hyperrl.data.images import vision_samples

        paths = [src] if isinstance(src, str) else list(src)
        if not all(isinstance(x, str) for x in paths):
            raise DataError("data with images: give data files (parquet / JSONL / JSON), not records")
        out = []
        for path in paths:
            for v in vision_samples(path, prompt_key=prompt_key, image_key=self.image_key, image_root=self.image_root,
                                    max_pixels=getattr(self.image_processor, "max_pixels", None)):
                self._images[v.source] = v.images
                out.append(Sample(v.prompt, v.answer, v.source, v.extra))
        return PromptDataset(out)

    def _encode(self, prompt) -> list[int]:
        from hyperrl.data.images import placeholders_as_text

        return super()._encode(placeholders_as_text(prompt, IMAGE_TEXT))

    def vision(self, sample: Sample):
        """The row's ``(pixel_values [p, D], image_grid_thw [n, 3])`` from the model's image processor, or None for
        a row without images."""
        key = sample.source
        if key in self._vision:
            self._vision.move_to_end(key)
            return self._vision[key]
        images, got = self._images[key], None
        if images:
            out = self.image_processor(images=list(images), return_tensors="pt")
            got = (out["pixel_values"], out["image_grid_thw"])
        self._vision[key] = got
        if len(self._vision) > self.KEEP:
            self._vision.popitem(last=False)
        return got

    def encode(self, sample: Sample) -> list[int]:
        """The prompt's ids with each image's placeholder expanded to its grid."""
        v = self.vision(sample)
        return expand_placeholders(super().encode(sample), self.image_token_id, None if v is None else v[1],
                                   self.merge)


def _dataset(src, prompt_key: str) -> PromptDataset:
    """Paths (a str or a list) → files; a PromptDataset as is; anything else iterable → records."""
    if isinstance(src, PromptDataset):
        return src
    if isinstance(src, str) or (isinstance(src, list | tuple) and all(isinstance(x, str) for x in src)):
        return PromptDataset.from_files(src, prompt_key=prompt_key)
    return PromptDataset.from_records(src, where=type(src).__name__, prompt_key=prompt_key)


@register_task("modsum", produces=("reward",))
def modsum(tokenizer, seed: int, *, modulus: int = 10, max_operand: int = 9,
           rewards: tuple[RewardName, ...] = ("first_char_exact",)) -> ModSumTask:
    """``(a + b) mod modulus`` with operands ``0..max_operand``, generated in code (single-digit answers)."""
    if not 2 <= modulus <= 10:
        raise ValueError(f"task.modulus={modulus}: answers must be single digits (2 ≤ modulus ≤ 10)")
    return ModSumTask(tokenizer, modulus, max_operand, seed, _reward_fns(rewards, "task.rewards"))


@register_task("arith", produces=("reward",))
def arith(tokenizer, seed: int, *, ops: str = "+", min_operand: int = 0, max_operand: int = 49,
          held_out_frac: float = 0.1, split_seed: int = 0, pad: bool = True,
          rewards: tuple[RewardName, ...] = ("digit_match", "exact_answer")) -> ArithTask:
    """``a op b`` for ``op`` in ``ops`` (``+``, ``-``: ``a ≥ b``) with operands ``min_operand..max_operand``,
    a fixed ``held_out_frac`` of the problems held out for evaluation. The default task of
    ``hyperrl train``: sums of ``0..49`` with carries, written at a fixed width (``pad``: ``"07+25="``
    → ``"32"`` + EOS, answers ``00..98``), 250 of the 2,500 problems held out; reward: exact match
    plus the dense per-place ``digit_match`` (exact match alone never fires from random weights: a
    random policy emits the right 3 tokens with probability ≈ 1e-6). Enough problems that a tiny
    model cannot memorise them in the budget: it learns the digit-wise rule, which transfers to the
    held-out pairs (sums of ``0..19``: 360 training problems, memorised, 0.75 held out).
    ``ops="+-", max_operand=99``: answers of up to 3 digits (``rollout.max_new_tokens=4``)."""
    if not ops or set(ops) - {"+", "-"} or len(set(ops)) != len(ops):
        raise ValueError(f"task.ops={ops!r}: a string of distinct operators from '+-'")
    if not 0 <= min_operand <= max_operand:
        raise ValueError(f"task.min_operand={min_operand}, task.max_operand={max_operand}: need 0 ≤ min ≤ max")
    return ArithTask(tokenizer, ops, min_operand, max_operand, held_out_frac, split_seed, pad, seed,
                     _reward_fns(rewards, "task.rewards"))


@register_task("products", produces=("reward",))
def products(tokenizer, seed: int, *, min_first: int = 100, max_first: int = 999, min_second: int = 10,
             max_second: int = 99, held_out_frac: float = 0.02, split_seed: int = 0, pad: bool = True,
             rewards: tuple[RewardName, ...] = ("digit_match", "exact_answer")) -> ArithTask:
    """Products a tiny model cannot compute in its head — the tool-use task (environment
    ``calculator_copy``): ``"347*28="`` → ``"09716"`` + EOS, a three-digit times a two-digit number
    (81,000 problems; answers of 4–5 digits, zero-padded to 5 with ``pad`` so a digit's place is its
    position), a fixed ``held_out_frac`` of the pairs (1,620) held out. Each sample's
    ``extra["expression"]`` is the unpadded ``"347*28"`` a calculator evaluates."""
    if not 0 <= min_first <= max_first or not 0 <= min_second <= max_second:
        raise ValueError(f"task.min_first..max_first={min_first}..{max_first}, task.min_second..max_second="
                         f"{min_second}..{max_second}: need 0 ≤ min ≤ max for each operand")
    return ArithTask(tokenizer, "*", min_first, max_first, held_out_frac, split_seed, pad, seed,
                     _reward_fns(rewards, "task.rewards"), second=(min_second, max_second))


@register_task("repeat", produces=("reward",))
def repeat(tokenizer, seed: int, *, short_max: int = 3, tail_min: int = 12, tail_max: int = 20, tail_frac: float = 0.2,
           held_out_frac: float = 0.15, split_seed: int = 0,
           rewards: tuple[RewardName, ...] = ("digit_credit", "exact_answer")) -> RepeatTask:
    """``"d*k="`` → ``d`` repeated ``k`` times: most answers ``1..short_max`` digits, a ``tail_frac`` of
    ``tail_min..tail_max`` (a long-tail length distribution; ``rollout.max_new_tokens`` ≥ tail_max + 1)."""
    if not 1 <= short_max < tail_min <= tail_max:
        raise ValueError(f"task.short_max={short_max}, tail_min={tail_min}, tail_max={tail_max}: need "
                         "1 ≤ short_max < tail_min ≤ tail_max")
    if not 0 <= tail_frac <= 1:
        raise ValueError(f"task.tail_frac={tail_frac}: must be in [0, 1]")
    return RepeatTask(tokenizer, short_max, tail_min, tail_max, tail_frac, held_out_frac, split_seed, seed,
                      _reward_fns(rewards, "task.rewards"))


@register_task("postfix", produces=("reward",))
def postfix(tokenizer, seed: int, *, max_digit: int = 9, held_out_frac: float = 0.15, split_seed: int = 0,
            rewards: tuple[RewardName, ...] = ("program_passes",)) -> PostfixTask:
    """A linear function of ``x`` in postfix notation (``"x3*1+="``) → a Python expression computing it, judged by
    running it against the sample's tests in the sandbox (many programs are right: ``3*x+1``, ``x*3+1``,
    ``1+3*x``); ``max_digit`` × (2·``max_digit`` + 1) functions (a in 1..max_digit, b in −max_digit..max_digit), a
    fixed ``held_out_frac`` held out. ``configs/code.yaml`` trains it with the ``code`` reward (pass fraction, and
    all-pass as the held-out pass rate)."""
    if not 1 <= max_digit <= 9:
        raise ValueError(f"task.max_digit={max_digit}: single digits, 1..9")
    return PostfixTask(tokenizer, max_digit, held_out_frac, split_seed, seed, _reward_fns(rewards, "task.rewards"))


# What a task over the user's own data sets when the config leaves these keys unset (the schema's
# defaults are the embedded arith task's: 3-token answers, 4,000 steps): a response budget for
# real answers (verl's max_response_length default, 512 tokens), a batch one machine generates
# (TRL's num_generations, 8, over 8 prompts), 64 validation prompts per evaluation, and a checkpoint
# every 50 steps, the newest 3 kept (a real model's step takes minutes; its checkpoint gigabytes).
FILE_TASK_SETTINGS = {"rollout.max_new_tokens": 512, "rollout.prompts_per_step": 8, "rollout.n": 8,
                      "run.steps": 500, "run.eval_prompts": 64, "run.ckpt_every": 50, "run.keep_last_k": 3}


@register_task("shapes", produces=("reward",), capabilities=TaskCapabilities(takes_images=True, needs_images=True))
def shapes(tokenizer, seed: int, image_processor=None, *, grid: int = 2, cell: int = 28, colours: str = "rgby",
           questions: tuple[Literal["colour", "count"], ...] = ("colour",), held_out_frac: float = 0.2,
           split_seed: int = 0, rewards: tuple[RewardName, ...] = ("digit_match", "exact_answer")):
    """The visual task (a vision-language model; :mod:`hyperrl.data.visual`): an image of ``grid × grid`` cells of
    ``cell`` pixels, each one of ``colours`` (letters of ``hyperrl.data.visual.PALETTE``); ``questions``: ``colour``
    (``"c2?"`` → cell 2's colour letter) and/or ``count`` (``"#r?"`` → how many cells are red); answers are one
    character + EOS; a fixed ``held_out_frac`` of the boards held out. ``image_processor``: the model's (given by the
    composition root, not configured)."""
    from hyperrl.data.visual import PALETTE, ShapesTask

    bad = sorted(set(colours) - set(PALETTE))
    if bad or len(set(colours)) != len(colours) or len(colours) < 2:
        raise ValueError(f"task.colours={colours!r}: two or more distinct letters of {''.join(PALETTE)}"
                         + (f" ({bad} unknown)" if bad else ""))
    if not questions or set(questions) - {"colour", "count"}:
        raise ValueError(f"task.questions={list(questions)}: a non-empty list of colour | count")
    if "count" in questions and grid * grid > 9:
        raise ValueError(f"task.grid={grid}: count answers must be one digit (grid ≤ 3 with count questions)")
    if grid < 1 or cell < 14:
        raise ValueError(f"task.grid={grid}, task.cell={cell}: grid ≥ 1 and cell ≥ 14 pixels (one patch)")
    if image_processor is None:
        raise ValueError("task shapes needs the model's image processor: train a vision-language model "
                         "(model.vision, or a Qwen-VL model.checkpoint)")
    return ShapesTask(tokenizer, image_processor, grid, cell, colours, tuple(questions), held_out_frac, split_seed,
                      seed, _reward_fns(rewards, "task.rewards"))



@register_task("parquet", produces=("reward",), settings=FILE_TASK_SETTINGS)
def parquet(tokenizer, seed: int, *, path: str, val_path: str | None = None,
            rewards: tuple[RewardName, ...] = ("gsm8k_exact",)) -> FileTask:
    """Prompts from a verl-style parquet file (``prompt``, ``reward_model.ground_truth`` …);
    evaluation on ``val_path``."""
    return FileTask(tokenizer, path, val_path, rewards, seed=seed)


@register_task("files", produces=("reward",), settings=FILE_TASK_SETTINGS,
               capabilities=TaskCapabilities(takes_images=True))
def files(tokenizer, seed: int, image_processor=None, *, train_files: tuple[str, ...], val_files: tuple[str, ...] = (),
          rewards: tuple[RewardName, ...] = ("gsm8k_exact",), prompt_key: str = "prompt", max_prompt_length: int = 0,
          overlong_prompts: Literal["error", "filter", "truncate"] = "error",
          apply_chat_template: Literal["auto", "always", "never"] = "auto", image_root: str | None = None) -> FileTask:
    """Prompts from parquet / JSONL / JSON files (verl's columns), validation from ``val_files``;
    what ``data.train_files`` / ``data.val_files`` build. With a vision-language model (``image_processor``, given
    by the composition root) the rows may carry images (:class:`VisionFileTask`: verl's or TRL's format; their
    paths inside the data file's directory or ``image_root``)."""
    kw = dict(seed=seed, prompt_key=prompt_key, max_prompt_length=max_prompt_length,
              overlong_prompts=overlong_prompts, apply_chat_template=apply_chat_template)
    if image_processor is not None:
        return VisionFileTask(tokenizer, image_processor, list(train_files), list(val_files) or None, rewards,
                              image_root=image_root, **kw)
    if image_root is not None:
        raise ValueError(f"image_root={image_root!r}: where a vision-language model's images are read from; this "
                         "model reads no images — remove it")
    return FileTask(tokenizer, list(train_files), list(val_files) or None, rewards, **kw)



class PreferenceTask:
    """Preference pairs for DPO and kin (``algo.preference``): training pairs from ``train`` through a
    resumable shuffled cursor, validation pairs from ``val`` (:mod:`hyperrl.data.preference`: TRL's and
    verl's formats, encoded once when read). No rewards: the pairs are the signal."""

    rewards: tuple = ()

    def __init__(self, tokenizer, train, val=None, *, seed: int = 0, prompt_key: str = "prompt",
                 chosen_key: str = "chosen", rejected_key: str = "rejected", max_prompt_length: int = 0,
                 overlong_prompts: str = "error", apply_chat_template: str = "auto"):
        from hyperrl.data.preference import PairDataset

        kw = dict(prompt_key=prompt_key, chosen_key=chosen_key, rejected_key=rejected_key,
                  apply_chat_template=apply_chat_template, max_prompt_length=max_prompt_length,
                  overlong_prompts=overlong_prompts)
        self.tokenizer = tokenizer
        self.dataset = PairDataset.from_files(train, tokenizer, **kw)
        self.val = PairDataset.from_files(val, tokenizer, **kw) if val else None
        self.loader = PromptLoader(self.dataset, 1, seed=seed)
        self.longest_sequence = max(self.dataset.longest, self.val.longest if self.val else 0)

    def limits(self) -> TaskLimits:
        """Its longest pair (prompt + the longer completion)."""
        return TaskLimits(longest_sequence=self.longest_sequence)

    def sample(self, k: int, step: int, attempt: int = 0) -> list:
        """The next ``k`` pairs of the resumable cursor."""
        return self.loader.next_batch(k)

    def held_out(self, k: int) -> list:
        """The first ``k`` validation pairs (all when fewer) — never training pairs."""
        if self.val is None:
            raise DataError("evaluation needs validation pairs: set data.val_files, or run.eval_every=0")
        return self.val.pairs[: min(k, len(self.val))]

    def encode_pair(self, pair):
        """The pair's :class:`~hyperrl.data.preference.EncodedPair` (prompt, chosen and rejected ids)."""
        ds = self.dataset if pair.source in self.dataset.encoded else self.val
        return ds.encode(pair)

    def encode(self, pair) -> list[int]:
        """The pair's prompt ids."""
        return list(self.encode_pair(pair).prompt)

    state, load_state = FileTask.state, FileTask.load_state


PREFERENCE_TASK_SETTINGS = {"rollout.prompts_per_step": 8, "run.steps": 500, "run.eval_prompts": 64,
                            "run.ckpt_every": 50, "run.keep_last_k": 3}


@register_task("preference", settings=PREFERENCE_TASK_SETTINGS, capabilities=TaskCapabilities(pairs=True))
def preference(tokenizer, seed: int, *, train_files: tuple[str, ...], val_files: tuple[str, ...] = (),
               prompt_key: str = "prompt", chosen_key: str = "chosen", rejected_key: str = "rejected",
               max_prompt_length: int = 0, overlong_prompts: Literal["error", "filter", "truncate"] = "error",
               apply_chat_template: Literal["auto", "always", "never"] = "auto") -> PreferenceTask:
    """Preference pairs from parquet / JSONL / JSON files in TRL's or verl's format (``prompt``,
    ``chosen``, ``rejected``; conversational or plain; implicit prompts), validation pairs from
    ``val_files``; what ``data.train_files`` builds for ``algo.preference`` (``algo.recipe=dpo``).
    ``rollout.prompts_per_step`` is the pairs per step (over all ranks)."""
    return PreferenceTask(tokenizer, list(train_files), list(val_files) or None, seed=seed, prompt_key=prompt_key,
                          chosen_key=chosen_key, rejected_key=rejected_key, max_prompt_length=max_prompt_length,
                          overlong_prompts=overlong_prompts, apply_chat_template=apply_chat_template)


def make_task(spec, tokenizer, seed: int, image_processor=None):
    """Build the task a config section ``{name, **hyperparams}`` names (see :mod:`hyperrl.config`); a task whose
    factory declared ``takes_images`` (:class:`TaskCapabilities`) gets the model's ``image_processor``."""
    fn = TASKS.build(spec.name, **spec.args)
    takes = TASKS.factory(spec.name).capabilities_for().takes_images
    task = fn(tokenizer, seed, image_processor) if takes else fn(tokenizer, seed)
    missing = [m for m in _TASK_MEMBERS if not hasattr(task, m)]
    if missing:
        raise TypeError(f"task={spec.name}: {type(task).__name__} lacks {', '.join(missing)} — a task has "
                        f"{', '.join(_TASK_MEMBERS)} (hyperrl.data.tasks' module doc; InCodeTask gives the defaults)")
    return task


_TASK_MEMBERS = ("sample", "held_out", "encode", "rewards", "state", "load_state", "limits")
