# Sourced by .ci/run: start a throw-away PostgreSQL server on a free loopback port for the distributed-tuning test
# and export SB3_SPEEDUPS_TEST_POSTGRES_URL. It must never fail CI: on any problem it says why and returns, and
# the test that needs the server is then skipped with that reason.
# shellcheck shell=bash

_sb3_pg_log() { echo "postgres.sh: $*"; }

# the unprivileged user may not be able to read the checkout: run its commands from /tmp, in a subshell so that
# the working directory of .ci/run stays as it is
_sb3_pg_in_tmp() { (cd /tmp && "$@"); }

_sb3_pg_bindir() {
  local dir
  for dir in /usr/lib/postgresql/*/bin; do
    if [ -x "$dir/initdb" ] && [ -x "$dir/pg_ctl" ]; then echo "$dir"; fi
  done | sort -V | tail -n 1
}

_sb3_pg_start() {
  local bindir user port data run_as
  bindir="$(_sb3_pg_bindir)"
  if [ -z "$bindir" ] && [ "$(id -u)" = "0" ] && command -v apt-get >/dev/null 2>&1; then
    _sb3_pg_log "installing Debian's postgresql package"
    if ! DEBIAN_FRONTEND=noninteractive timeout 600 apt-get install -y -q postgresql >/dev/null 2>&1; then
      timeout 300 apt-get update -q >/dev/null 2>&1 || true
      DEBIAN_FRONTEND=noninteractive timeout 600 apt-get install -y -q postgresql >/dev/null 2>&1 || true
    fi
    bindir="$(_sb3_pg_bindir)"
  fi
  if [ -z "$bindir" ]; then
    _sb3_pg_log "no PostgreSQL server binaries (initdb, pg_ctl) found and none could be installed"
    return 0
  fi

  # the server refuses to run as root: run it as an unprivileged user
  if [ "$(id -u)" = "0" ]; then
    user=postgres
    if ! id "$user" >/dev/null 2>&1; then
      useradd --system --no-create-home --shell /usr/sbin/nologin "$user" >/dev/null 2>&1 || true
    fi
    if ! id "$user" >/dev/null 2>&1; then
      _sb3_pg_log "cannot create an unprivileged user for the server"
      return 0
    fi
    run_as=(_sb3_pg_in_tmp runuser -u "$user" --)
  else
    user="$(id -un)"
    run_as=(_sb3_pg_in_tmp)
  fi

  port="$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])' 2>/dev/null)"
  data="$(mktemp -d /tmp/sb3-speedups-pg.XXXXXX 2>/dev/null)"
  if [ -z "$port" ] || [ -z "$data" ]; then
    _sb3_pg_log "cannot pick a free port or make a data folder"
    return 0
  fi
  chown "$user" "$data" 2>/dev/null || true
  chmod 700 "$data"
  # loopback only, trust authentication: the server lives for this CI run and holds nothing
  if ! "${run_as[@]}" "$bindir/initdb" -D "$data/db" -U postgres -A trust -E UTF8 >"$data/initdb.log" 2>&1; then
    _sb3_pg_log "initdb failed: $(tail -n 1 "$data/initdb.log" 2>/dev/null)"
    return 0
  fi
  if ! "${run_as[@]}" "$bindir/pg_ctl" -D "$data/db" -l "$data/server.log" -w -t 60 \
    -o "-c listen_addresses=127.0.0.1 -p $port -k $data" start >/dev/null 2>&1; then
    _sb3_pg_log "the server did not start: $(tail -n 1 "$data/server.log" 2>/dev/null)"
    return 0
  fi
  if ! "${run_as[@]}" "$bindir/psql" -h 127.0.0.1 -p "$port" -U postgres -d postgres -q \
    -c "CREATE DATABASE sb3_speedups_test" >/dev/null 2>&1; then
    _sb3_pg_log "cannot create the test database"
    "${run_as[@]}" "$bindir/pg_ctl" -D "$data/db" -m immediate stop >/dev/null 2>&1 || true
    return 0
  fi
  export SB3_SPEEDUPS_TEST_POSTGRES_URL="postgresql://postgres@127.0.0.1:$port/sb3_speedups_test"
  # stop the server when .ci/run ends, unless it has an EXIT trap of its own (the machine ends it then anyway)
  if [ -z "$(trap -p EXIT)" ]; then
    # shellcheck disable=SC2064  # expand now: the variables are local
    trap "cd /tmp && ${run_as[*]:1} $bindir/pg_ctl -D $data/db -m fast stop >/dev/null 2>&1; rm -rf $data" EXIT
  fi
  _sb3_pg_log "PostgreSQL running on 127.0.0.1:$port (SB3_SPEEDUPS_TEST_POSTGRES_URL exported)"
  return 0
}

_sb3_pg_start || _sb3_pg_log "unexpected error; PostgreSQL tests will be skipped"
unset -f _sb3_pg_start _sb3_pg_bindir _sb3_pg_log _sb3_pg_in_tmp
