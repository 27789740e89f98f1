"""Structured outputs: constrain sampling to a JSON schema, regex, choice list or grammar (llguidance).

    spec = spec_from_request(body)                   # None when the request asks for nothing
    compiled = await compiler.compile_async(spec)    # cached, off the step loop; 400 on a bad schema
    matcher = compiled.matcher()                     # one per sequence; .fork() for n > 1
    apply_structured_masks(logits, [matcher or None for each row])   # in the sampler, before sampling
    matcher.accept(token_id)                         # after sampling; is_terminated() -> finish
    matcher.rebuild(output_token_ids)                # after preemption / recompute
"""
from kvflow.structured_output.bitmask import (allocate_bitmask, apply_bitmask, apply_structured_masks,
                                              fill_bitmask, unpack_bitmask)
from kvflow.structured_output.compiler import CompiledGrammar, GrammarCompiler, grammar_tokenizer
from kvflow.structured_output.matcher import Matcher
from kvflow.structured_output.spec import StructuredSpec, json_schema_spec, spec_from_request

__all__ = ["StructuredSpec", "spec_from_request", "json_schema_spec", "GrammarCompiler", "CompiledGrammar",
           "grammar_tokenizer", "Matcher", "allocate_bitmask", "fill_bitmask", "apply_bitmask",
           "unpack_bitmask", "apply_structured_masks"]
