"""The built-in `math` reward: is the model's final answer equivalent to the reference's?

    math(prompts, completions, solution=None, answer=None, **fields) -> list[float | None]

- The model's answer is the content of the completion's last `\\boxed{…}`, else its last number.
- The reference is the record's `answer` (GSM8K's "… #### 72" gives 72) or the last `\\boxed{…}`
  of its `solution` (MATH). A row with neither gets None: the reward does not apply to it.
- 1.0 when the two are equivalent, else 0.0. Two plain numbers are compared as canonical strings
  (tasks.canonical_number: "1,000" and "1000.0" agree). Anything else is decided by math-verify,
  the verifier TRL and open-r1 use: it parses both as LaTeX (never as Python: its expression
  parser, which calls sympy's eval-based parse_expr, is not used) and compares them with sympy.

The completion is text a model wrote, and sympy can be made to work for ever (9^{9^{9^9}}) in C
code that math-verify's own timeout (SIGALRM, whole seconds) cannot interrupt. So:
- answers longer than MAX_ANSWER_CHARS, nested deeper than MAX_BRACE_DEPTH, or holding a TeX
  definition command score 0 without being parsed (a 10^5-digit number, a 100 KB run of braces);
- math-verify runs in a worker process (`python -m grpo.rewards.math_reward`) with its own timeouts of
  one second, a memory limit and a CPU-time limit; a row that takes longer than ROW_SECONDS of
  wall time has its worker killed (restarted for the next row) and scores 0. That deadline is the
  one place where a reward can depend on the machine's load: an answer that sympy needs most of a
  second to compare may score 0 on a busy machine (such a row is not remembered, so it is asked
  again the next time it comes).
"""

import atexit
import json
import os
import re
import select
import subprocess
import sys

from grpo.rewards.tasks import canonical_number, completion_text, last_number

MAX_ANSWER_CHARS = 1000
MAX_BRACE_DEPTH = 24
ROW_SECONDS = 0.8
WORKER_MEMORY_BYTES = 4 << 30
# TeX that defines or expands macros; math-verify would not expand it, but nothing the model wrote
# is ever treated as a program.
DEFINITIONS = re.compile(r"\\(?:def|edef|gdef|xdef|let|newcommand|renewcommand|providecommand|"
                         r"DeclareMathOperator|csname|expandafter|input|include|catcode)(?![a-zA-Z])")


def last_boxed(text):
    """The content of the last \\boxed{…} (or \\fbox{…}) of `text`, or None; one linear scan, which
    gives up after MAX_ANSWER_CHARS characters of content."""
    start = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
    if start < 0:
        return None
    brace = text.find("{", start)
    if brace < 0 or text[start:brace].strip() not in ("\\boxed", "\\fbox"):
        return None
    depth = 0
    for i in range(brace, min(len(text), brace + MAX_ANSWER_CHARS + 2)):
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if depth == 0:
            return text[brace + 1:i].strip()
    return None


def model_answer(text):
    """The completion's final answer: its last \\boxed{…} (None if that cannot be read), else its last
    number, else None."""
    if "\\boxed" in text or "\\fbox" in text:
        return last_boxed(text)
    return last_number(text)


def reference_answer(solution=None, answer=None):
    """The record's reference: `answer` (after GSM8K's "####" when it has one), else the last \\boxed{…}
    of `solution`; None when there is neither."""
    if answer is not None and str(answer).strip():
        answer = str(answer)
        return answer.rpartition("####")[2].strip().replace(",", "") if "####" in answer else answer.strip()
    if isinstance(solution, str):
        return last_boxed(solution)
    return None


def too_hostile(text):
    """Answers never parsed: too long, too deeply nested, or holding a TeX definition command."""
    if len(text) > MAX_ANSWER_CHARS or DEFINITIONS.search(text):
        return True
    depth = deepest = 0
    for ch in text:
        depth += {"{": 1, "}": -1}.get(ch, 0)
        deepest = max(deepest, depth)
    return deepest > MAX_BRACE_DEPTH


class Verifier:
    """math-verify in a worker process, restarted after a row that overran ROW_SECONDS."""

    def __init__(self):
        self.process = None

    def start(self):
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        path = os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))
        env = {**os.environ, "PYTHONPATH": path}
        self.process = subprocess.Popen([sys.executable, "-m", "grpo.rewards.math_reward"], stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env)
        if self.read_line(timeout=60) != "ready":
            self.stop()
            raise RuntimeError("the math-verify worker did not start (is math-verify installed?)")

    def stop(self):
        if self.process is not None:
            self.process.kill()
            self.process.wait()
            self.process = None

    def read_line(self, timeout):
        ready, _, _ = select.select([self.process.stdout], [], [], timeout)
        return self.process.stdout.readline().decode().strip() if ready else None

    def equivalent(self, prediction, reference):
        """True or False; None when there is no verdict: the row ran out of time (the worker is then
        killed) or the worker died on it. A worker found dead before the row is replaced, once."""
        for _ in range(2):
            if self.process is None or self.process.poll() is not None:
                self.start()
            try:
                self.process.stdin.write((json.dumps([prediction, reference]) + "\n").encode())
                self.process.stdin.flush()
            except BrokenPipeError:               # it died since it was last asked
                self.stop()
                continue
            reply = self.read_line(ROW_SECONDS)
            if reply not in ("0", "1"):           # out of time, or it died on this row
                self.stop()
                return None
            return reply == "1"
        return None


VERIFIER = Verifier()
atexit.register(VERIFIER.stop)


def equivalent(prediction, reference):
    """Is the model's answer equivalent to the reference? Plain numbers by their canonical strings,
    everything else by math-verify in the worker; no verdict in time is a 0."""
    if too_hostile(prediction):
        return False
    number, gold_number = canonical_number(prediction), canonical_number(reference)
    if number is not None and gold_number is not None:
        return number == gold_number
    return bool(verified(prediction, reference))


VERDICTS = {}              # math-verify's verdicts, remembered: a group's samples often agree
MAX_VERDICTS = 65536


def verified(prediction, reference):
    """math-verify's verdict (None: none in time, which is not remembered, so it is asked again)."""
    key = (prediction, reference)
    if key not in VERDICTS:
        verdict = VERIFIER.equivalent(prediction, reference)
        if verdict is None:
            return None
        if len(VERDICTS) >= MAX_VERDICTS:
            VERDICTS.clear()
        VERDICTS[key] = verdict
    return VERDICTS[key]


def math(prompts, completions, solution=None, answer=None, **fields):
    """1.0 when the completion's final answer is equivalent to the record's reference, 0.0 when not,
    None for a row without a reference."""
    n = len(completions)
    solution, answer = solution or [None] * n, answer or [None] * n
    rewards = []
    for completion, sol, ans in zip(completions, solution, answer):
        reference = reference_answer(sol, ans)
        if reference is None:
            rewards.append(None)
            continue
        prediction = model_answer(completion_text(completion))
        rewards.append(float(prediction is not None and equivalent(prediction, reference)))
    return rewards


def serve():
    """The worker: reads [prediction, reference] lines, answers "1" or "0" per line."""
    import resource

    from math_verify import LatexExtractionConfig, parse, verify

    resource.setrlimit(resource.RLIMIT_AS, (WORKER_MEMORY_BYTES, WORKER_MEMORY_BYTES))
    _, cpu_hard = resource.getrlimit(resource.RLIMIT_CPU)
    replies = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)                                 # what math-verify prints goes to the discarded stderr
    config = [LatexExtractionConfig(boxed_match_priority=0)]

    def parsed(text):
        return parse(f"\\boxed{{{text}}}", extraction_config=config, parsing_timeout=1)

    def check(prediction, reference):
        try:
            gold, guess = parsed(reference), parsed(prediction)
            return bool(gold and guess and verify(gold, guess, timeout_seconds=1))
        except Exception:  # a parse or comparison that fails in any way (MemoryError included) is a 0
            return False

    def limit_cpu(seconds):
        """SIGXCPU ends the worker `seconds` CPU-seconds from now."""
        usage = resource.getrusage(resource.RUSAGE_SELF)
        soft = int(usage.ru_utime + usage.ru_stime) + seconds
        resource.setrlimit(resource.RLIMIT_CPU,
                           (soft if cpu_hard == resource.RLIM_INFINITY else min(soft, cpu_hard), cpu_hard))

    check("(x+1)^2", "x^2+2x+1")                  # sympy's first comparison is slow: pay it before "ready"
    print("ready", file=replies, flush=True)
    for line in sys.stdin:
        prediction, reference = json.loads(line)
        # The parent kills a row that overruns; should the parent itself be gone, the kernel ends the
        # worker a few CPU-seconds into the row rather than let it compute for ever.
        limit_cpu(3)
        print("1" if check(prediction, reference) else "0", file=replies, flush=True)


if __name__ == "__main__":
    serve()
