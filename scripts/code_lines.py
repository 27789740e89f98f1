"""Code lines of kvflow/ outside server/ and bench/ at a git revision (no blanks, comments or docstrings):
    python scripts/code_lines.py [REV] [REPO] [-v]    (-v: per file)"""
import ast, io, subprocess, sys, tokenize


def files_at(rev: str = "HEAD", repo: str = ".") -> dict[str, str]:
    """The counted files' sources at `rev`: kvflow/**.py outside server/ and bench/."""
    names = subprocess.run(["git", "-C", repo, "ls-tree", "-r", "--name-only", rev, "kvflow/"],
                           capture_output=True, text=True).stdout.split()
    return {f: subprocess.run(["git", "-C", repo, "show", f"{rev}:{f}"], capture_output=True, text=True).stdout
            for f in names if f.endswith(".py") and not f.startswith(("kvflow/server/", "kvflow/bench/"))}


def code_lines(src: str) -> set[int]:
    """The line numbers that hold code: not blank, not only a comment, not part of a docstring."""
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
        for line in range(tok.start[0], tok.end[0] + 1):
            if line not in doc_lines:
                code.add(line)
    return code


if __name__ == "__main__":
    rev = sys.argv[1] if len(sys.argv) > 1 else "HEAD"
    repo = sys.argv[2] if len(sys.argv) > 2 and sys.argv[2] != "-v" else "."
    per = {f: len(code_lines(src)) for f, src in files_at(rev, repo).items()}
    if "-v" in sys.argv:
        for f, n in sorted(per.items(), key=lambda x: -x[1]):
            print(f"{n:5d} {f}")
    print(sum(per.values()))
