"""How much of scripts/code_lines.py's count is code that later issues added after the architecture issue (13)
was filed at 9b193a1 (3,136 code lines): their own files, and the named functions they added to shared files.
Lines they changed inside other functions are not subtracted, so the like-for-like figure is an upper bound.
    python scripts/later_feature_lines.py [REV]"""
import ast, os, sys
sys.path.insert(0, os.path.dirname(__file__))
from code_lines import code_lines, files_at  # noqa: E402

OWN_FILES = ("kvflow/structured_output/",                     # structured outputs and tools
             "kvflow/layers/int4.py", "kvflow/kernels/group_quant.py",      # int4 / GGUF codes
             "kvflow/kernels/", "kvflow/runner/compiled_decode.py",   # CPU speed
             "kvflow/models/gguf_codes.py")
PIECES = {
    "kvflow/layers/quantization.py": ["GGUFVocabulary", "_native_head", "_vocabulary", "_int4_linear", "_gguf_codes",
                                      "_choose_int4_kernel"],
    "kvflow/models/gguf_reader.py": ["group_quantized", "_GROUP_BLOCKS"],
    "kvflow/models/loader.py": ["_gguf_tensor", "weight_quantization", "_FOUR_BITS_OR_FEWER", "_FLOAT_TYPES"],
    "kvflow/models/llama.py": ["LlamaForCausalLM._keep_codes"],
    "kvflow/runner/sampler.py": ["Sampler._apply_grammars"],
    "kvflow/core/scheduler.py": ["Scheduler._check_grammar"],
    "kvflow/llm.py": ["LLM.grammar_compiler", "LLM._compile"],
    "kvflow/runner/model_runner.py": ["ModelRunner._start_compiled_decode", "ModelRunner.threads_for",
                                      "ModelRunner._padding_step"],
}


def node_named(tree: ast.Module, name: str):
    cls, _, leaf = name.rpartition(".")
    for node in tree.body:
        if cls and isinstance(node, ast.ClassDef) and node.name == cls:
            return next((n for n in node.body if getattr(n, "name", None) == leaf), None)
        if not cls and getattr(node, "name", None) == leaf:
            return node
        if not cls and isinstance(node, ast.Assign) and any(getattr(t, "id", None) == leaf for t in node.targets):
            return node
    return None


rev = sys.argv[1] if len(sys.argv) > 1 else "HEAD"
sources = files_at(rev)
total = sum(len(code_lines(src)) for src in sources.values())
own = sum(len(code_lines(src)) for f, src in sources.items() if f.startswith(OWN_FILES))
pieces = 0
for f, names in PIECES.items():
    src = sources.get(f, "")
    code, tree = code_lines(src), ast.parse(src)
    for name in names:
        node = node_named(tree, name)
        if node is None:            # not there (yet) at this revision
            continue
        start = min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])])
        pieces += sum(start <= line <= node.end_lineno for line in code)
print(f"code lines {total}; later issues' own files {own}; their functions in shared files {pieces}; "
      f"like-for-like {total - own - pieces}")
