"""Code lines of kvflow/ outside server/ and bench/ at a git revision (no blanks, comments or docstrings):
    python scripts/code_lines.py [REV] [REPO] [-v]    (-v: per file)"""
import ast, io, subprocess, sys, tokenize
rev = sys.argv[1] if len(sys.argv) > 1 else "HEAD"
repo = sys.argv[2] if len(sys.argv) > 2 and sys.argv[2] != "-v" else "."
files = subprocess.run(["git", "-C", repo, "ls-tree", "-r", "--name-only", rev, "kvflow/"], capture_output=True, text=True).stdout.split()
total = 0; per = {}
for f in files:
    if not f.endswith(".py") or f.startswith(("kvflow/server/", "kvflow/bench/")):
        continue
    src = subprocess.run(["git", "-C", repo, "show", f"{rev}:{f}"], capture_output=True, text=True).stdout
    doc_lines = set()
    for node in ast.walk(ast.parse(src)):
        if isinstance(node, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.body:
            b = node.body[0]
            if isinstance(b, ast.Expr) and isinstance(b.value, ast.Constant) and isinstance(b.value.value, str):
                doc_lines.update(range(b.lineno, b.end_lineno + 1))
    code = set()
    for tok in tokenize.generate_tokens(io.StringIO(src).readline):
        if tok.type in (tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT, tokenize.ENDMARKER):
            continue
        for l in range(tok.start[0], tok.end[0] + 1):
            if l not in doc_lines:
                code.add(l)
    per[f] = len(code); total += len(code)
if "-v" in sys.argv:
    for f, n in sorted(per.items(), key=lambda x: -x[1]):
        print(f"{n:5d} {f}")
print(total)
