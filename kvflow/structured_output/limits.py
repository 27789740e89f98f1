"""What a structured-output constraint may cost, in one place: past any of these a request is a 400 naming its field.

A grammar is checked three ways before it reaches the engine (see compiler.py):
  1. request-side caps (spec.py): a choice list's length, and JSON nesting past Python's recursion limit;
  2. the grammar check process (grammar_check.py): the grammar text is made and validated in a child process, so a
     grammar that overflows llguidance's stack (~3000 chained Lark rules or ~1000 chained `$ref`s kill a process
     on an 8 MiB stack) or runs for ever (GBNF conversion is quadratic in the rule count) costs a restarted child
     and a 400, never the server;
  3. the probe (compiler.py): the matcher is built with parser_limits() and runs the first PROBE_TOKENS tokens of a
     generation, because llguidance builds its lexer lazily and some limits only trip on the first token.
The engine rebuilds the grammar with the same parser_limits(), so what passed here behaves the same there.
Figures below: SmolLM2's 49k vocabulary on a loaded 2-core x86 machine (the CI box).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:      # the request side (spec.py) imports this module and must not load llguidance
    import llguidance

TOO_COMPLEX = "grammar_too_complex"    # the 400's `code` when a limit, not the syntax, refused a constraint

# ---------------------------------------------------------------------------------------------- request side
# `choice` becomes one Earley alternative per entry, and llguidance's parser keeps at most 2000 items in a row:
# a list of 2000 or more always failed on its first token (measured), so a round cap well inside it.
MAX_CHOICES = 1000
# Nesting of a JSON schema: llguidance reads schemas with serde_json, which refuses more than 128 levels; spec.py
# turns Python's RecursionError on deeper ones (past ~1000 levels; it was a 500) into the same 400.

# ---------------------------------------------------------------------------------------------- llguidance
# Lexer fuel for building the regexes and the first token-trie walk. llguidance's default, 1_000_000, let
# `(a{1000}){1000}` spend 1.6-2.5 s before failing; 300_000 fails it in 0.3-0.7 s. The largest legitimate
# grammars tried need less: a 10k-value enum 300_000 (the most), a 1000-entry choice list 100_000,
# 50 generated schemas, date-time / email / uuid formats and 1000 required properties <= 30_000.
INITIAL_LEXER_FUEL = 300_000
# Per mask step (llguidance's defaults): they bound what one constrained row adds to a step.
STEP_LEXER_FUEL = 200_000
STEP_MAX_ITEMS = 50_000
MAX_ITEMS_IN_ROW = 2000
# Lexer states (1-2 kB each) and grammar symbols: llguidance's defaults.
MAX_LEXER_STATES = 250_000
MAX_GRAMMAR_SIZE = 500_000

# ---------------------------------------------------------------------------------------------- kvflow's checks
# The probe generates PROBE_TOKENS tokens, trying at each step, on a copy each, the PROBE_BRANCHES longest tokens
# the grammar allows and the longest per first byte: `(a{1000}){1000}` passed the build and the first mask, then
# failed on its first token in the engine (a 500, and a poisoned shared lexer after it); a schema of 2000 optional
# properties fails on `{"` (not on `{}`). A probe takes 2-500 ms (50 generated schemas: 2 ms each; 2000
# properties: 0.5 s); one whose first tokens take PROBE_TIME_LIMIT_S would hold every step of every stream as long.
PROBE_TOKENS = 8
PROBE_BRANCHES = 64
PROBE_TIME_LIMIT_S = 2.0
# Wall-clock bound on the grammar check process for one spec; past it the child is killed and the request is a
# 400. The slowest legitimate check seen took ~1 s (a 10k-property schema); a 3000-rule GBNF chain takes ~8 s.
CHECK_TIMEOUT_S = 10.0
# Stack of the thread that checks a grammar in the child (a common default thread stack), and of the threads that
# build it in the server and the engine: llguidance recurses once per rule of a chain (~3 kB a level; 4 MiB
# overflowed at ~1300, 8 MiB at ~2700), so what fits the check's stack fits the builders' with an 8x margin. Masks
# and tokens do not recurse so (a 2600-rule chain generated to the end on a 1 MiB stack). Threads reserve stack
# lazily: 64 MiB costs what it uses.
CHECK_THREAD_STACK_BYTES = 8 * 2**20
BUILD_THREAD_STACK_BYTES = 64 * 2**20


def clean_error(message: str) -> str:
    """llguidance's error message without the marker that verbose_errors=False appends."""
    return message.replace("<non-verbose/>", "").strip()


def parser_limits() -> llguidance.LLParserLimits:
    """llguidance's limits for every matcher kvflow builds (the check, the server's build, the engine's rebuild)."""
    import llguidance

    return llguidance.LLParserLimits(
        initial_lexer_fuel=INITIAL_LEXER_FUEL, step_lexer_fuel=STEP_LEXER_FUEL, step_max_items=STEP_MAX_ITEMS,
        max_items_in_row=MAX_ITEMS_IN_ROW, max_lexer_states=MAX_LEXER_STATES, max_grammar_size=MAX_GRAMMAR_SIZE,
        verbose_errors=False)   # verbose errors append the parser state and the whole grammar to the 400's message
