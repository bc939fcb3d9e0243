# Sourced by the CI steps (.ci/*): what they share.
#
# A step that needs a set-up of its own (a virtual environment of another jax or
# Python, a build of its own) has two parts: `bash .ci/<step> setup` makes it, and
# `bash .ci/<step>` runs the step, making the set-up first where no finished one
# is there. .ci/run starts the set-ups in the background, niced, while the
# README's test command runs, so that their downloads and builds take the time
# the tests leave idle (network waits, a test worker's last minutes).

# requirements LIST...: pyproject.toml's requirement lists, one requirement a
# line. LIST: "dependencies" (the project's), "build" (build-system.requires) or
# the name of an extra ("test", "accel-check").
requirements() {
  python3 - "$@" <<'PY'
import sys, tomllib
p = tomllib.load(open("pyproject.toml", "rb"))
named = {"dependencies": p["project"]["dependencies"], "build": p["build-system"]["requires"]}
for name in sys.argv[1:]:
    print("\n".join(named.get(name) or p["project"]["optional-dependencies"][name]))
PY
}

# set_up_once MARKER COMMAND...: runs COMMAND unless MARKER (a file that a finished
# set-up leaves) exists, then leaves MARKER. The set-up's COMMAND removes what an
# unfinished one left.
set_up_once() {
  local marker=$1
  shift
  if [[ ! -f "$marker" ]]; then
    "$@"
    touch "$marker"
  fi
}
