# Sourced by the peer-suite runners: resolve the peer project's repository they take as an
# argument, or stop with a message naming what is missing.
#
#   peer_git_dir NAME PATH REF   prints the git directory of PATH (a checkout with a work
#                                tree, or a bare / mirror git directory) after checking that
#                                REF names a commit in it; exits 2 naming NAME, PATH or REF
#                                when it does not.

peer_git_dir() {
  local name="$1" path="$2" ref="$3" gitdir
  if [ -z "$path" ]; then
    echo "error: no $name repository given: pass a git checkout of $name (git clone" \
         "https://github.com/$name) as the first argument" >&2
    exit 2
  fi
  if [ ! -e "$path" ]; then
    echo "error: the $name repository $path does not exist (a git checkout of $name is" \
         "needed: git clone https://github.com/$name $path)" >&2
    exit 2
  fi
  if ! gitdir="$(git -C "$path" rev-parse --absolute-git-dir 2>/dev/null)"; then
    if git --git-dir="$path" rev-parse --git-dir >/dev/null 2>&1; then
      gitdir="$(cd "$path" && pwd)"
    else
      echo "error: $path is not a git checkout of $name" >&2
      exit 2
    fi
  fi
  if ! git --git-dir="$gitdir" rev-parse --verify -q "$ref^{commit}" >/dev/null; then
    echo "error: the $name repository $path has no commit named $ref (git -C $path fetch" \
         "--tags, or pass another ref)" >&2
    exit 2
  fi
  printf '%s\n' "$gitdir"
}
