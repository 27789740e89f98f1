"""Reasoning parsers (vLLM's `--reasoning-parser`): a reasoning model's output text -> its reasoning and its answer.

One state machine per choice reads the generated text as it grows (`ReasoningSplitter.push`, then `finish`), so a
marker split over several tokens or chunks is found all the same, and the whole text (`split`) is cut exactly where
the stream is: a splitter holds back only a suffix that could still become a marker. The markers themselves belong to
neither part. The chat route runs it (`OpenAIServing`: `message.reasoning` / `delta.reasoning`), and the Responses and
Messages APIs read the chat route's parts back (reasoning items, thinking blocks); tool calls and everything else
that reads the answer see only the answer.

  deepseek_r1  <think> reasoning </think> answer. The output starts in the reasoning: text before </think> is
               reasoning even without an opening <think> (R1's template puts it in the prompt); no </think>: all of it
               is reasoning (cut by max_tokens). An opening <think> is dropped where it comes before </think>.
  qwen3        as deepseek_r1, and: with `chat_template_kwargs: {"enable_thinking": false}` the output is the answer
               from its first character; a `<tool_call>` followed by `<function` (Qwen3.5's call syntax) ends the
               reasoning too, the tag staying in the answer, as vLLM's parser has it.
  granite      Here is my thought process: reasoning Here is my response: answer ("Here's" as well). Output that does
               not open with the first marker is all answer.

vLLM's parsers read marker tokens; these read marker text, since a model kvflow serves may spell a marker in several
tokens. Where vLLM's two paths disagree (text before an opening <think>: dropped whole, kept streamed; granite without
its response marker: all answer whole, reasoning streamed), kvflow does what vLLM's streaming path does, for both.
Either way, with `enable_thinking` false, or when the prompt already closed the reasoning (it ends with an end marker:
a template that writes an empty `<think></think>` itself), the output is all answer (vLLM's `prompt_is_reasoning_end`).

Where the engine must know the reasoning's end too (a grammar constrains the answer only; a thinking budget forces the
end), `thinking_spec` hands it the parser's end marker (`END_MARKERS`) as token ids with the same `in_reasoning`
(kvflow/structured_output/thinking.py).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Mapping

from kvflow.structured_output.thinking import ThinkingSpec

THINK_START, THINK_END = "<think>", "</think>"
TOOL_CALL, FUNCTION = "<tool_call>", "<function"
GRANITE_STARTS = ("Here is my thought process:", "Here's my thought process:")
GRANITE_ENDS = ("Here is my response:", "Here's my response:")


def _held_back(text: str, markers: tuple[str, ...]) -> int:
    """Length of the longest suffix of text that could be the start of one of the markers."""
    best = 0
    for marker in markers:
        for k in range(min(len(marker) - 1, len(text)), best, -1):
            if marker.startswith(text[-k:]):
                best = k
                break
    return best


def _first(text: str, markers: tuple[str, ...]) -> tuple[int, str]:
    """(index, marker) of the earliest whole marker in text; (-1, "") if none."""
    found = [(i, m) for m in markers if (i := text.find(m)) != -1]
    return min(found, key=lambda f: f[0]) if found else (-1, "")


class ReasoningSplitter:
    """One choice's output -> (reasoning, answer) pieces as it grows. `push` returns what can be told apart now;
    `finish` flushes the held-back tail. `reasoning_end`: where the reasoning, its end marker included, ends in the
    output text (None while it has not ended, or when there was none: `has_reasoning`)."""

    def __init__(self, in_reasoning: bool = True) -> None:
        self.state = "reasoning" if in_reasoning else "content"
        self.has_reasoning = in_reasoning
        self.reasoning_end: int | None = None
        self._buf = ""           # text not yet told apart
        self._seen = 0           # characters pushed so far

    def push(self, text: str) -> tuple[str, str]:
        self._seen += len(text)
        self._buf += text
        reasoning, content = [], []
        while self._buf:
            if self.state == "content":
                content.append(self._buf)
                self._buf = ""
            elif not self._step(reasoning, content):
                break
        return "".join(reasoning), "".join(content)

    def finish(self) -> tuple[str, str]:
        """The end of the output: held-back text goes to the part it is in (a marker cut short stays text)."""
        rest, self._buf = self._buf, ""
        if self.state == "content":
            return "", rest
        if self.state == "start":            # a prefix of the opening marker and nothing else: answer
            self.state, self.has_reasoning = "content", False
            return "", rest
        return rest, ""

    def split(self, text: str) -> tuple[str, str]:
        """A whole output -> (reasoning, answer): push + finish."""
        r1, c1 = self.push(text)
        r2, c2 = self.finish()
        return r1 + r2, c1 + c2

    def _end_reasoning(self, at: int) -> None:
        """The reasoning ends at self._buf[at] (past its marker)."""
        self.state = "content"
        self.reasoning_end = self._seen - len(self._buf) + at

    def _step(self, reasoning: list[str], content: list[str]) -> bool:
        """Take what can be told apart from the front of self._buf; False: wait for more text."""
        raise NotImplementedError


class ThinkSplitter(ReasoningSplitter):
    """<think> reasoning </think> answer (deepseek_r1, qwen3)."""

    def __init__(self, in_reasoning: bool = True, tool_call_ends: bool = False) -> None:
        super().__init__(in_reasoning)
        self.opened = False                  # the opening <think> was seen (and dropped)
        self.tool_call_ends = tool_call_ends  # qwen3: <tool_call><function ... ends the reasoning

    def _markers(self) -> tuple[str, ...]:
        return ((THINK_END,) + (() if self.opened else (THINK_START,))
                + ((TOOL_CALL,) if self.tool_call_ends else ()))

    def _step(self, reasoning: list[str], content: list[str]) -> bool:
        buf = self._buf
        markers = self._markers()
        i, marker = _first(buf, markers)
        if i == -1:
            keep = _held_back(buf, markers)
            reasoning.append(buf[:len(buf) - keep])
            self._buf = buf[len(buf) - keep:]
            return False
        reasoning.append(buf[:i])
        if marker == THINK_START:
            self.opened = True
            self._buf = buf[i + len(marker):]
        elif marker == THINK_END:
            self._end_reasoning(i + len(marker))
            self._buf = buf[i + len(marker):]
        else:                                 # <tool_call>: an end only if <function follows (spaces aside)
            after = buf[i + len(marker):].lstrip()
            if after.startswith(FUNCTION):
                self._end_reasoning(i)
                self._buf = buf[i:]           # the call stays in the answer, for the tool-call parser
            elif FUNCTION.startswith(after):  # cannot tell yet
                self._buf = buf[i:]
                return False
            else:                             # a <tool_call> mentioned in the reasoning
                reasoning.append(marker)
                self._buf = buf[i + len(marker):]
        return True


class GraniteSplitter(ReasoningSplitter):
    """Here is my thought process: reasoning Here is my response: answer (granite)."""

    def __init__(self, in_reasoning: bool = True) -> None:
        super().__init__(in_reasoning)
        if in_reasoning:
            self.state = "start"             # the output must open with the first marker

    def _step(self, reasoning: list[str], content: list[str]) -> bool:
        buf = self._buf
        if self.state == "start":
            opened = next((m for m in GRANITE_STARTS if buf.startswith(m)), None)
            if opened is not None:
                self.state = "reasoning"
                self._buf = buf[len(opened):]
                return True
            if any(m.startswith(buf) for m in GRANITE_STARTS):
                return False                 # still a prefix of the marker
            self.state, self.has_reasoning = "content", False     # no reasoning: all of it is answer
            return True
        i, marker = _first(buf, GRANITE_ENDS)
        if i == -1:
            keep = _held_back(buf, GRANITE_ENDS)
            reasoning.append(buf[:len(buf) - keep])
            self._buf = buf[len(buf) - keep:]
            return False
        reasoning.append(buf[:i])
        self._end_reasoning(i + len(marker))
        self._buf = buf[i + len(marker):]
        return True


def prompt_ends_reasoning(parser: str, prompt_text: str) -> bool:
    """Whether the prompt itself closed the reasoning (vLLM's `prompt_is_reasoning_end`): it ends with an end marker
    (whitespace aside), as a template that writes `<think>\\n\\n</think>\\n\\n` for a model told not to think
    leaves it. Only at its end: an earlier turn's `</think>` (Qwen3's template writes the reasoning of the turns
    since the last user message) closed that turn's reasoning, not the reply's (vLLM's token walk takes it for the
    reply's, a known false positive)."""
    tail = prompt_text.rstrip()
    return tail.endswith(GRANITE_ENDS if parser == "granite" else (THINK_END,))


@dataclass(frozen=True)
class ReasoningRequest:
    """What one chat request's choices are split by: the parser's name, and whether the output starts in the
    reasoning (False: thinking disabled by the request, or closed by the prompt)."""
    parser: str
    in_reasoning: bool = True
    include_reasoning: bool = True           # false: the reasoning is split off and not returned (vLLM's)

    def splitter(self) -> ReasoningSplitter:
        return SPLITTERS[self.parser](self.in_reasoning)


def reasoning_request(parser: str, template_kwargs: Mapping, prompt_text: str,
                      include_reasoning: bool = True) -> ReasoningRequest:
    """The splitting a chat request gets: `template_kwargs` are its chat_template_kwargs (qwen3 reads
    enable_thinking), `prompt_text` its rendered prompt."""
    thinking_off = parser == "qwen3" and template_kwargs.get("enable_thinking", True) is False
    return ReasoningRequest(parser, not thinking_off and not prompt_ends_reasoning(parser, prompt_text),
                            include_reasoning)


# the end-of-thinking marker each parser's engine-side end is (a grammar starts after it; a thinking budget forces it)
END_MARKERS = {"deepseek_r1": THINK_END, "qwen3": THINK_END, "granite": GRANITE_ENDS[0]}


def thinking_spec(reasoning: ReasoningRequest, encode: Callable[[str, bool], list[int]], budget: int | None = None,
                  budget_message: str | None = None) -> ThinkingSpec:
    """Where the engine sees a request's reasoning end (structured_output/thinking.py): the parser's end marker as
    `encode(text, add_special_tokens)` writes it, whether the output starts in the reasoning, and what a spent
    `budget` forces: `budget_message` (--reasoning-budget-message), then the marker."""
    end = tuple(encode(END_MARKERS[reasoning.parser], False))
    forced = (tuple(encode(budget_message, False)) if budget_message else ()) + end
    return ThinkingSpec(end, reasoning.in_reasoning, budget, forced if budget is not None else ())


SPLITTERS: dict[str, Callable[[bool], ReasoningSplitter]] = {   # keys: config.REASONING_PARSERS
    "deepseek_r1": ThinkSplitter,
    "qwen3": lambda in_reasoning: ThinkSplitter(in_reasoning, tool_call_ends=True),
    "granite": GraniteSplitter,
}


def reasoning_tokens(splitter: ReasoningSplitter, token_ids: list[int], decode: Callable[[list[int]], str]) -> int:
    """How many of a finished choice's tokens are reasoning (its end marker's included): all of them while the
    reasoning never ended, none without reasoning, else the shortest prefix whose text reaches the end marker's end
    (a binary search over decoded prefixes)."""
    if not splitter.has_reasoning:
        return 0
    if splitter.reasoning_end is None:
        return len(token_ids)
    lo, hi = 0, len(token_ids)
    while lo < hi:
        mid = (lo + hi) // 2
        if len(decode(token_ids[:mid])) >= splitter.reasoning_end:
            hi = mid
        else:
            lo = mid + 1
    return lo
