#!/usr/bin/env bash
# Install what the MySQL/MariaDB tests need, if it is not there yet (Debian packages):
# - `mariadb-server`: the server the tests in tests/core/test_mysql_*.py and
#   tests/airflow/test_keyset_mysql.py run against (127.0.0.1:3306, root, empty password, db test);
# - `pkg-config` and `libmariadb-dev`: mysqlclient (the `mysql-native` extra, `mysql+mysqldb://`)
#   builds from source against them.
# Idempotent: does nothing when all are present; otherwise one `apt-get update`, then one install
# of the missing packages. Needs root (apt-get); the package mirror is its only network access.
# The server is started by .ci/run (and its root@127.0.0.1 login set up there).
set -euo pipefail
missing=()
[ -x /usr/sbin/mariadbd ] || missing+=(mariadb-server mariadb-client)
command -v pkg-config >/dev/null 2>&1 || missing+=(pkg-config)
if ! { command -v pkg-config >/dev/null 2>&1 && pkg-config --exists libmariadb; }; then
  missing+=(libmariadb-dev)
fi
command -v cc >/dev/null 2>&1 || missing+=(gcc libc6-dev)
if [ ${#missing[@]} -eq 0 ]; then
  exit 0
fi
export DEBIAN_FRONTEND=noninteractive
apt-get update -q
apt-get install -y -q --no-install-recommends "${missing[@]}"
[ -x /usr/sbin/mariadbd ]
pkg-config --exists libmariadb
