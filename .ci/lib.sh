# Sourced by the CI steps (.ci/*): what they share.

# requirements LIST...: pyproject.toml's requirement lists, one requirement a
# line. LIST: "dependencies" (the project's) or the name of an extra ("test",
# "accel-check").
requirements() {
  python3 - "$@" <<'PY'
import sys, tomllib
p = tomllib.load(open("pyproject.toml", "rb"))
for name in sys.argv[1:]:
    print("\n".join(p["project"]["dependencies"] if name == "dependencies"
                    else p["project"]["optional-dependencies"][name]))
PY
}
