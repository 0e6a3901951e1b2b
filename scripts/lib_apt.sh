# Sourced by scripts/setup.sh and scripts/setup_test.sh: installs Debian packages, saying which and why
# before it does, as root directly or through sudo.
#
#   apt_ensure WHAT PKG...   install those of PKG that dpkg does not list as installed. WHAT says what
#                            they are for ("the demo", "the browser tests") in the messages.
#
# Environment:
#   DUPLEXKIT_SKIP_APT=1     check and install nothing (other distributions, containers, no root)
#   APT_DRY_RUN=1            (set by the caller's --dry-run) print what would be installed, install nothing
# Exit status of apt_ensure: 0 done (or nothing to do); 1 the packages could not be installed (one
# "[setup] error:" line says why and what to do instead).

apt_ensure() {
  local what=$1
  shift
  if [[ ${DUPLEXKIT_SKIP_APT:-0} == 1 ]]; then
    [[ ${APT_DRY_RUN:-0} == 1 ]] && echo "[setup] system packages for $what: $* (not checked: DUPLEXKIT_SKIP_APT=1)"
    return 0
  fi
  local missing=() p
  if command -v dpkg >/dev/null 2>&1; then
    for p in "$@"; do
      dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p")
    done
  else
    missing=("$@")
  fi
  if [[ ${APT_DRY_RUN:-0} == 1 ]]; then
    if ((${#missing[@]})); then
      echo "[setup] system packages for $what: $* (would apt-get install: ${missing[*]})"
    else
      echo "[setup] system packages for $what: $* (all installed)"
    fi
    return 0
  fi
  ((${#missing[@]})) || return 0
  if ! command -v apt-get >/dev/null 2>&1; then
    echo "[setup] error: $what needs the Debian packages ${missing[*]}, and this system has no apt-get:" \
      "install their equivalents with your package manager, then re-run with DUPLEXKIT_SKIP_APT=1" >&2
    return 1
  fi
  local sudo=() how="as root"
  if [[ $(id -u) -ne 0 ]]; then
    if command -v sudo >/dev/null 2>&1; then
      sudo=(sudo)
      how="through sudo (it may ask for your password)"
    else
      echo "[setup] error: $what needs the Debian packages ${missing[*]}; installing them needs root, and this" \
        "user is not root and has no sudo: run 'apt-get install ${missing[*]}' as root (or install sudo)," \
        "then re-run with DUPLEXKIT_SKIP_APT=1" >&2
      return 1
    fi
  fi
  echo "[setup] installing system packages for $what $how: apt-get install ${missing[*]} (apt adds what they depend on)"
  if ! { "${sudo[@]}" apt-get update -q && "${sudo[@]}" env DEBIAN_FRONTEND=noninteractive \
         apt-get install -y -q --no-install-recommends "${missing[@]}"; }; then
    echo "[setup] error: apt-get could not install ${missing[*]} (its message is above: no network, no sudo rights," \
      "or another distribution?): install them another way and re-run with DUPLEXKIT_SKIP_APT=1" >&2
    return 1
  fi
}
