"""Long documents under a budget: a RULER-style synthetic suite (Hsieh et al. 2024), generated locally.

Every item is real filler text (license texts, tokenized with the model's own tokenizer) with a few
sentences hidden at chosen depths, then a question and the first words of its answer, so that greedy
decoding emits the answer first (plain completion; the default model is a 270M instruct model):

- ``single``: one pass key (a 5-digit number); the question asks for it (as the passkey test does);
- ``multikey``: several people's pass keys, the asked one at the depth and the others as distractors;
- ``multivalue``: one person with several pass keys at different depths; the question asks for all;
- ``vartrack``: chains of variable assignments (VAR ABCDE = 12345, VAR FGHIJ = VAR ABCDE, ...) spread
  through the filler; the question asks which variables hold the first chain's value;
- ``fact``: a fact in words ("The secret ingredient of the recipe is cinnamon.") among distractor facts.

A prompt is exactly ``length`` tokens: intro + filler with the sentences + question + answer prefix. The
question's tokens are also given alone, as what a question-guided reading is told to look for. Each
configuration reads the whole prompt through its controller (``BoundedSession.read``: the cache is
compressed chunk by chunk before the question comes), then answers greedily; the score is 1 or 0 for
the one-answer tasks, the fraction of the keys found for multivalue, and for vartrack the variables found over
those expected plus the decoy chain's the answer names (``score_answer``).
"""

from __future__ import annotations

import random
import re
import string
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .budget import Budget
from .engine import Engine
from .session import SessionSpec, open_session
from .textfile import license_files

TASKS = ("single", "multikey", "multivalue", "vartrack", "fact")
# greedy tokens decoded for each task's answer (digits are single tokens for Gemma's tokenizer)
ANSWER_TOKENS = {"single": 8, "multikey": 8, "multivalue": 24, "vartrack": 24, "fact": 6}

INTROS = {
    "single": "There is an important piece of information hidden inside a lot of irrelevant text. "
    "Find it and memorize it. I will quiz you about it.\n\n",
    "multikey": "Pass keys of several people are hidden in irrelevant text. Memorize them.\n\n",
    "multivalue": "Several pass keys of one person are hidden inside a lot of irrelevant text. "
    "Find all of them and memorize them. I will quiz you about them.\n\n",
    "vartrack": "Chains of variable assignments are hidden inside a lot of irrelevant text. "
    "Memorize and track them. I will quiz you about them.\n\n",
    "fact": "There are important facts hidden inside a lot of irrelevant text. "
    "Find them and memorize them. I will quiz you about one of them.\n\n",
}
NAMES = (
    "Alice", "Bob", "Carol", "David", "Emma", "Frank", "Grace", "Henry", "Irene", "James", "Karen", "Louis",
    "Maria", "Nathan", "Olivia", "Peter", "Rachel", "Samuel", "Teresa", "Victor", "Wendy", "Xavier",
)  # fmt: skip
SUBJECTS = (
    "secret ingredient of the recipe", "name of the ship", "color of the front door", "favorite fruit of the captain",
    "animal on the flag", "metal of the old key", "flower in the garden", "instrument of the teacher",
)  # fmt: skip
WORDS = (
    "cinnamon", "saffron", "vanilla", "ginger", "nutmeg", "lavender", "copper", "silver", "violet", "orange",
    "falcon", "tiger", "dolphin", "walnut", "harbor", "thunder", "marble", "velvet", "cactus", "lantern",
    "pepper", "coconut", "crimson", "emerald", "turtle", "piano", "violin", "sparrow", "tulip", "bronze",
)  # fmt: skip
ARTICLES = ("a", "an", "the")
# after the question: without it the 270M model often answers "the key to the computer" (from the filler)
NUMBER = "Remember: the pass key is a number."
SEPARATOR = "\n\n"  # around every hidden sentence, and before the question


@dataclass(frozen=True)
class LongdocItem:
    """One prompt of the suite and what answers it."""

    task: str
    length: int  # prompt tokens, exactly
    depth: float  # where the asked sentence sits, as a fraction of the filler
    depths: tuple[float, ...]  # where every hidden sentence sits (in the order they were hidden)
    prompt: list[int]  # intro + filler with the sentences + question + answer prefix
    question: list[int]  # the question's own tokens (they also sit in the prompt, before the answer prefix)
    expected: tuple[str, ...]  # the answer(s)
    sentences: tuple[str, ...]  # the hidden sentences

    def score(self, answer: str) -> float:
        variables = set(re.findall(r"VAR ([A-Z]{5})", " ".join(self.sentences)))  # vartrack: the chain and the decoys'
        return score_answer(self.task, self.expected, answer, variables - set(self.expected))


@dataclass
class LongdocTrial:
    label: str
    policy: str
    budget: Budget
    reading: str
    task: str
    length: int
    depth: float
    trial: int
    expected: str  # comma-separated
    answer: str
    score: float
    solved: bool
    peak_cells: int
    prompt_seconds: float
    layer_budgets: str = "shared"  # how the budget was laid out on the layers (SessionSpec.layer_budgets)


# -- scoring ---------------------------------------------------------------------------------------


def score_answer(task: str, expected: Sequence[str], answer: str, wrong: Collection[str] = ()) -> float:
    """single, multikey: 1 if the first number of the answer is the key; fact: 1 if its first word (past an
    article) is the word, in any case; multivalue: the fraction of the keys among its numbers; vartrack: the
    variables among its 5-letter capitalized names over the variables plus the ``wrong`` ones it names (the decoy
    chain's: naming every variable of the prompt scored 1, where the task is to tell the chains apart)."""
    if task in ("single", "multikey"):
        m = re.search(r"\d+", answer)
        return float(m is not None and m.group(0) == expected[0])
    if task == "fact":
        words = [w for w in re.findall(r"[a-z]+", answer.lower()) if w not in ARTICLES]
        return float(bool(words) and words[0] == expected[0].lower())
    if task == "multivalue":
        found = set(re.findall(r"\d+", answer))
    elif task == "vartrack":
        found = set(re.findall(r"\b[A-Z]{5}\b", answer))
    else:
        raise ValueError(f"unknown task {task!r}; choose from {', '.join(TASKS)}")
    return len(found & set(expected)) / (len(expected) + len(found & set(wrong)))


# -- generation ------------------------------------------------------------------------------------


def default_filler_files() -> list[Path]:
    """GPL-3, then every other license text (no links), in name order."""
    files = license_files("--filler FILE")
    return sorted(files, key=lambda p: p.name != "GPL-3")  # (stable: the rest stay in name order)


class Filler:
    """Filler tokens: the texts tokenized one after another, as many as a length needs."""

    def __init__(self, engine: Engine, texts: Sequence[str]):
        self.engine, self.texts, self.tokens, self._next = engine, list(texts), [], 0
        self._sep = engine.tokenize(SEPARATOR, add_bos=False)

    def take(self, n: int) -> list[int]:
        while len(self.tokens) < n and self._next < len(self.texts):
            if self.tokens:
                self.tokens += self._sep
            self.tokens += self.engine.tokenize(self.texts[self._next], add_bos=False)
            self._next += 1
        if len(self.tokens) < n:
            raise ValueError(f"the filler texts have {len(self.tokens)} tokens; {n} are needed")
        return self.tokens[:n]


def _keys(rng: random.Random, n: int) -> list[str]:
    return [str(k) for k in rng.sample(range(10_000, 100_000), n)]


def _var_names(rng: random.Random, n: int) -> list[str]:
    names: list[str] = []
    while len(names) < n:
        name = "".join(rng.choice(string.ascii_uppercase) for _ in range(5))
        if name not in names and name != "VALUE":
            names.append(name)
    return names


def _task(task: str, rng: random.Random, depth: float):
    """(hidden sentences with their depths, the asked one first; question; answer prefix; expected)."""
    if task == "single":
        (key,) = _keys(rng, 1)
        hidden = [(depth, f"The pass key is {key}. Remember it. {key} is the pass key.")]
        return hidden, f"What is the pass key? {NUMBER}", " The pass key is number", (key,)
    if task == "multikey":
        names, keys = rng.sample(NAMES, 4), _keys(rng, 4)
        pairs = zip(names, keys, strict=True)
        hidden = [(rng.random() if i else depth, f"The pass key of {n} is {k}.") for i, (n, k) in enumerate(pairs)]
        question = f"What is the pass key of {names[0]}? {NUMBER}"
        return hidden, question, f" The pass key of {names[0]} is number", (keys[0],)
    if task == "multivalue":
        name, keys = rng.choice(NAMES), _keys(rng, 3)
        hidden = [(rng.random() if i else depth, f"One of the pass keys of {name} is {k}.") for i, k in enumerate(keys)]
        question = f"What are all the pass keys of {name}? Remember: the pass keys are numbers."
        return hidden, question, f" The pass keys of {name} are:", tuple(keys)
    if task == "vartrack":
        value, other = _keys(rng, 2)
        names = _var_names(rng, 8)
        chain, decoy = names[:4], names[4:]
        at = [depth, *sorted(depth + (1 - depth) * rng.random() for _ in chain[1:])]
        hidden = [(at[0], f"VAR {chain[0]} = {value}.")]
        hidden += [(d, f"VAR {b} = VAR {a}.") for d, a, b in zip(at[1:], chain, chain[1:], strict=False)]
        at = sorted(rng.random() for _ in decoy)
        hidden += [(at[0], f"VAR {decoy[0]} = {other}.")]
        hidden += [(d, f"VAR {b} = VAR {a}.") for d, a, b in zip(at[1:], decoy, decoy[1:], strict=False)]
        question = f"Which variables are assigned the value {value}?"
        return hidden, question, f" The variables assigned the value {value} are VAR", tuple(chain)
    if task == "fact":
        subjects, words = rng.sample(SUBJECTS, 3), rng.sample(WORDS, 3)
        pairs = zip(subjects, words, strict=True)
        hidden = [(rng.random() if i else depth, f"The {s} is {w}.") for i, (s, w) in enumerate(pairs)]
        return hidden, f"What is the {subjects[0]}?", f" The {subjects[0]} is", (words[0],)
    raise ValueError(f"unknown task {task!r}; choose from {', '.join(TASKS)}")


def make_item(
    engine: Engine, filler: Filler | list[int], task: str, length: int, depth: float, seed: int | str = 0
) -> LongdocItem:
    """The item of ``task`` at ``length`` tokens with the asked sentence at ``depth`` of the filler; the same
    ``seed`` gives the same item. Raises ValueError for a length too short for the task or the filler."""
    hidden, question, prefix, expected = _task(task, random.Random(f"{seed}:{task}:{length}:{depth}"), depth)
    head = engine.tokenize(INTROS[task], add_bos=True)
    pieces = [engine.tokenize(f"{SEPARATOR}{s}{SEPARATOR}", add_bos=False) for _, s in hidden]
    q_tokens = engine.tokenize(f"{SEPARATOR}{question}", add_bos=False)
    tail = q_tokens + engine.tokenize(prefix, add_bos=False)
    n_fill = length - len(head) - sum(map(len, pieces)) - len(tail)
    if n_fill < 1:
        raise ValueError(f"length {length} is too short for the {task} prompt")
    fill = filler.take(n_fill) if isinstance(filler, Filler) else filler[:n_fill]
    if len(fill) < n_fill:
        raise ValueError(f"the filler has {len(fill)} tokens; {n_fill} are needed")
    order = sorted(range(len(hidden)), key=lambda i: (hidden[i][0], i))  # stable: a chain keeps its order
    body, cut = [], 0
    for i in order:
        at = round(hidden[i][0] * n_fill)
        body += fill[cut:at] + pieces[i]
        cut = at
    prompt = head + body + fill[cut:] + tail
    assert len(prompt) == length
    return LongdocItem(
        task, length, depth, tuple(d for d, _ in hidden), prompt, q_tokens, expected, tuple(s for _, s in hidden)
    )


def make_items(
    engine: Engine,
    filler: Filler,
    tasks: Sequence[str],
    length: int,
    depths: Sequence[float],
    trials: int = 1,
    seed: int = 0,
) -> list[tuple[int, LongdocItem]]:
    """(trial, item) for every task x depth x trial at one length."""
    return [
        (t, make_item(engine, filler, task, length, d, f"{seed}:{t}"))
        for task in tasks
        for d in depths
        for t in range(trials)
    ]


# -- configurations and the run --------------------------------------------------------------------


def parse_compressions(text: str) -> list[float]:
    """'4,8' or '4x,8x' -> [4.0, 8.0]; each at least 1 (1: as many cells as the prompt has tokens, which the budget
    holds as every budget is held, evict_every - 1 below it after each eviction: not the full cache)."""
    out = []
    for part in text.split(","):
        s = part.strip().lower().removesuffix("x")
        try:
            c = float(s)
        except ValueError:
            raise ValueError(f"a compression is a factor such as 4 or 8x, not {part!r}") from None
        if not (np.isfinite(c) and c >= 1):
            raise ValueError(
                f"a compression must be at least 1 (1: as many cells as the prompt has tokens), not {part!r}"
            )
        out.append(c)
    out = list(dict.fromkeys(out))  # each once ("4,4x" ran twice into one row of twice the items)
    named: dict[str, float] = {}
    for c in out:  # a row is labelled by the factor's short form: two factors that print alike merged their rows
        if (shown := f"{c:g}") in named:
            raise ValueError(f"compressions {named[shown]!r} and {c!r} are both labelled {shown}x: give distinct ones")
        named[shown] = c
    return out


def label_of(policy: str, compression: float, reading: str, layer_budgets: str = "shared") -> str:
    """'ahakv@8x', 'ahakv@8x+query', 'ahakv@8x+query adaptive': the same for every length (the cells differ);
    the layout is named outside the shared pool, as ``bench speed``'s rows."""
    label = f"{policy}@{compression:g}x" + ("" if reading == "plain" else f"+{reading}")
    return label if layer_budgets == "shared" else f"{label} {layer_budgets}"


def specs_rule(
    policies: Sequence[str],
    compressions: Sequence[float],
    readings: Sequence[str] = ("plain",),
    layouts: Sequence[str] = ("shared",),
    **schedule,
) -> Callable[[int], list[SessionSpec]]:
    """length -> [the full cache, then every policy x compression x reading x layout at length / compression
    cells (a cell budget is what a full-attention layer holds, so no layout allocates more bytes than the shared
    pool: the sliding-window layers of the others hold at most their window)].
    A policy that cannot be guided by a question reads plainly in the modes that need one (query, reconstruct), so
    it runs once for them; surprisal, which any policy reads by, runs as asked."""
    from .policies import make_policy

    def rule(length: int) -> list[SessionSpec]:
        specs = [SessionSpec()]
        for c in compressions:
            cells = max(1, int(length / c))
            for p in policies:
                guided = make_policy(p).reads_with_query
                modes = [r if guided or r == "surprisal" else "plain" for r in readings]
                for r in dict.fromkeys(modes):
                    for layout in layouts:
                        label = label_of(p, c, r, layout)
                        specs.append(
                            SessionSpec.bounded(p, cells, label=label, reading=r, layer_budgets=layout, **schedule)
                        )
        return specs

    return rule


def run_longdoc(
    model: Path,
    specs: Mapping[int, Sequence[SessionSpec]] | Callable[[int], Sequence[SessionSpec]],
    tasks: Sequence[str] = TASKS,
    lengths: Sequence[int] = (2048, 4096),
    depths: Sequence[float] = (0.1, 0.5, 0.9),
    trials: int = 1,
    seed: int = 0,
    n_ubatch: int = 64,
    answer_tokens: int | None = None,
    filler_texts: Sequence[str] | None = None,
    progress: Callable[[int, int], None] = lambda done, total: None,
    rpc_servers: tuple[str, ...] = (),
    n_threads: int | None = None,
) -> list[LongdocTrial]:
    """Every spec of each length on every task x depth x trial at that length (the full cache is
    ``SessionSpec()``; ``specs`` maps a length to its specs, or is a rule such as ``specs_rule``). One engine
    per spec and length; every item starts from an empty cache. ``answer_tokens``: None = per task.
    ``rpc_servers``: llama.cpp RPC workers that hold the layers; ``n_threads``: the engine's (None: every core)."""
    for task in tasks:
        if task not in TASKS:
            raise ValueError(f"unknown task {task!r}; choose from {', '.join(TASKS)}")
    spec_list = {n: list(specs(n) if callable(specs) else specs[n]) for n in lengths}
    if filler_texts is None:
        filler_texts = [p.read_text(encoding="utf-8", errors="replace") for p in default_filler_files()]
    most = answer_tokens or max(ANSWER_TOKENS[t] for t in tasks)
    total, done = sum(len(s) for s in spec_list.values()) * len(tasks) * len(depths) * trials, 0
    results: list[LongdocTrial] = []
    items: dict[int, list[tuple[int, LongdocItem]]] = {}
    for length in lengths:
        for spec in spec_list[length]:
            with open_session(
                model, spec, length + most, n_ubatch, rpc_servers=rpc_servers, n_threads=n_threads
            ) as session:
                engine = session.engine
                if not items:  # every length's, before any run (tokenization is the model's, whatever the spec): a
                    # length too short for a task, or past the filler, failed after the lengths before it had run
                    items = {
                        n: make_items(engine, Filler(engine, filler_texts), tasks, n, depths, trials, seed)
                        for n in lengths
                    }
                for trial, item in items[length]:
                    session.reset()  # an empty cache and a fresh policy for every item
                    start = time.perf_counter()
                    logits = session.read(item.prompt, item.question)
                    seconds = time.perf_counter() - start
                    out, peak = session.answer(logits, answer_tokens or ANSWER_TOKENS[item.task])
                    answer = engine.detokenize(out).strip()
                    score = item.score(answer)
                    results.append(
                        LongdocTrial(
                            spec.label, spec.policy, spec.budget, spec.reading, item.task, length, item.depth,
                            trial, ",".join(item.expected), answer, score, score == 1.0, peak, seconds,
                            spec.layer_budgets,
                        )
                    )  # fmt: skip
                    done += 1
                    progress(done, total)
    labels = list(dict.fromkeys(t.label for t in results))
    results.sort(key=lambda t: (labels.index(t.label), tasks.index(t.task), t.length, depths.index(t.depth), t.trial))
    return results


# -- the table -------------------------------------------------------------------------------------


def mean_scores(trials: Sequence[LongdocTrial]) -> tuple[list[str], list[tuple[str, int]], dict]:
    """(configurations, the full cache first; (task, length) columns; {(label, task, length): mean score})."""
    labels = list(dict.fromkeys(t.label for t in trials))
    labels.sort(key=lambda label: label != "full")
    tasks = list(dict.fromkeys(t.task for t in trials))
    columns = [(task, n) for task in tasks for n in sorted({t.length for t in trials})]
    scores: dict[tuple[str, str, int], list[float]] = {}
    for t in trials:
        scores.setdefault((t.label, t.task, t.length), []).append(t.score)
    return labels, columns, {k: float(np.mean(v)) for k, v in scores.items()}


def accuracy_table(trials: Sequence[LongdocTrial]) -> list[str]:
    """Markdown: the mean score per configuration (rows, the full cache first) and task x length, the average
    over the columns it has, and the mean prompt-reading time with, for a guided reading, its ratio to the same
    policy and compression read plainly (the guidance's cost, measured in the same run)."""
    labels, columns, means = mean_scores(trials)
    read_s: dict[str, list[float]] = {}
    for t in trials:
        read_s.setdefault(t.label, []).append(t.prompt_seconds)
    read = {label: float(np.mean(v)) for label, v in read_s.items()}
    reading = {t.label: t.reading for t in trials}
    lines = [
        "| configuration | " + " | ".join(f"{task} {n}" for task, n in columns) + " | average | read s | x plain |",
        "|---|" + "---:|" * (len(columns) + 3),
    ]
    for label in labels:
        row = [means.get((label, task, n)) for task, n in columns]
        have = [v for v in row if v is not None]
        cells = ["" if v is None else f"{v:.0%}" for v in row]
        # the same policy, compression and layout read plainly (label_of without "+<reading>")
        plain = read.get(label.replace(f"+{reading[label]}", "")) if reading[label] != "plain" else None
        ratio = f"{read[label] / plain:.2f}" if plain else ""
        lines.append(f"| {label} | " + " | ".join(cells) + f" | {np.mean(have):.0%} | {read[label]:.2f} | {ratio} |")
    return lines
