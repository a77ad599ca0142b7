# Sourced by the .ci scripts.

# as_root CMD...: runs CMD as root, directly or through sudo.
as_root() {
  if [[ $(id -u) -eq 0 ]]; then "$@"; else sudo "$@"; fi
}

# ensure_packages PKG...: installs those of the Debian packages that dpkg does not have, with one
# package-list update.
ensure_packages() {
  local missing=() p
  for p in "$@"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
  done
  ((${#missing[@]})) || return 0
  echo "installing: ${missing[*]}"
  as_root apt-get update -qq
  # Through env: sudo would not pass a VAR=value prefix on to apt-get.
  as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}"
}
