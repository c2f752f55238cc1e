#!/bin/sh
# Put /opt/eaglenest (steps/, flows/, configs/) on a venv's path and install the `eaglenest` command.
#
# A .pth file instead of `pip install .`: no build backend (and no unpinned setuptools download) is
# needed, and configs/ stays beside steps/ where steps.lib.config.find_config looks for `--config tiny`.
# The command goes to /usr/local/bin so it works whether or not the venv is first on PATH (the serve
# image keeps the base's python3 first: SGLang must run with its own packages).
# Usage: sh containers/install-source.sh VENV   (run as root in /opt/eaglenest, during the build)
set -eu
venv="$1"
site=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
echo /opt/eaglenest > "$site/eaglenest.pth"
printf '#!%s/bin/python\nimport sys\nfrom flows.cli import main\nsys.exit(main())\n' "$venv" > /usr/local/bin/eaglenest
chmod 0755 /usr/local/bin/eaglenest
ln -sf "$venv/bin/prefect" /usr/local/bin/prefect
chmod 0755 /usr/local/bin/eaglenest-entrypoint
# out/ is where relative paths in configs land (file://out/store, --log-dir out/serve)
mkdir -p /opt/eaglenest/out
chown 10001:10001 /opt/eaglenest/out
# fail the build, not the first run, if the source does not import with these dependencies
"$venv/bin/python" -c 'import flows.cli, steps.serve'
/usr/local/bin/eaglenest --help > /dev/null
