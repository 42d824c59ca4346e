"""`mlx-kvserve service install|uninstall|start|stop|restart|status|logs`."""

from __future__ import annotations

import argparse
import dataclasses
import sys
from typing import TYPE_CHECKING

from mlx_kvserve.config.flags import add_setting_flags, setting_flags
from mlx_kvserve.service.runner import Runner, SystemRunner
from mlx_kvserve.service.spec import DEFAULT_NAME, check_name

if TYPE_CHECKING:  # imported when a service command runs
    from mlx_kvserve.service.actions import Plan
    from mlx_kvserve.service.manage import Manager

_ACTIONS = {
    "install": "write the service file and start the server in the background (again: update)",
    "uninstall": "stop the server and remove the service file (the cache and logs stay)",
    "start": "start the installed service",
    "stop": "stop it gracefully (SIGTERM: requests drain, cache writes flush, exit 0)",
    "restart": "stop it gracefully and start it again",
    "status": "installed? loaded? running (PID)? its /health answer, log and cache size",
    "logs": "print the last lines of the server's log (-f to follow)",
}


def add_service_commands(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    service = sub.add_parser(
        "service",
        help="run the server in the background under launchd (macOS) or systemd (Linux)",
        description="Run the server as a per-user background service that starts at login and "
        "is restarted after a crash (not after a clean stop): a LaunchAgent on macOS, a "
        "`systemctl --user` unit on Linux. The prompt cache survives restarts, so a restarted "
        "server serves the same conversations from disk.",
    )
    actions = service.add_subparsers(dest="service_command", metavar="ACTION", required=True)
    for action, text in _ACTIONS.items():
        parser = actions.add_parser(action, help=text, description=text[0].upper() + text[1:] + ".")
        parser.add_argument(
            "--manager",
            choices=["launchd", "systemd"],
            default=None,
            help="launchd or systemd (default: launchd on macOS, systemd on Linux; the other "
            "one works with --dry-run, to review its file)",
        )
        parser.add_argument(
            "--name",
            default=DEFAULT_NAME,
            help=f"service name, for several instances: the unit <name>.service, the launchd "
            f"label io.github.<name> (default {DEFAULT_NAME})",
        )
        if action in ("install", "uninstall", "start", "stop", "restart"):
            parser.add_argument(
                "--dry-run",
                action="store_true",
                help="print the file it would write and every command it would run; change nothing",
            )
        if action == "logs":
            parser.add_argument("-n", "--lines", type=int, default=50, help="lines to show (50)")
            parser.add_argument("-f", "--follow", action="store_true", help="keep printing")
        if action == "install":
            parser.epilog = (
                "Every `serve` option below is passed to the service's `serve` command, except "
                "API keys, which go into its environment (a 0600 file) so that `ps` cannot show "
                "them. The service also gets this shell's MLX_KVSERVE_* variables and the "
                "config file's path."
            )
            add_setting_flags(parser)


def run_service_command(args: argparse.Namespace, runner: Runner | None = None) -> int:
    from mlx_kvserve.service import manage
    from mlx_kvserve.service.actions import ServiceError, execute

    runner = runner or SystemRunner()
    kind = args.manager or manage.default_manager()
    dry_run = getattr(args, "dry_run", False)
    if kind is None:
        print(f"error: no service manager on {sys.platform}; try --manager launchd --dry-run")
        return 2
    native = manage.default_manager()
    if kind != native and not dry_run:
        print(f"error: {kind} does not run on {sys.platform}; add --dry-run to review its file")
        return 2
    try:
        manager = manage.make_manager(kind, check_name(args.name))
    except ValueError as exc:
        print(f"error: {exc}")
        return 2
    action = args.service_command
    if action == "status":
        return manage.status(manager, runner)
    if action == "logs":
        return manage.logs(manager, runner, max(0, args.lines), args.follow)
    try:
        plan = _install_plan(manager, args) if action == "install" else getattr(manager, action)()
        execute(plan, runner, dry_run=dry_run)
    except (ServiceError, ValueError, OSError) as exc:
        print(f"error: {exc}")
        return 1
    return 0


def _install_plan(manager: Manager, args: argparse.Namespace) -> Plan:
    from mlx_kvserve.config.precedence import load_settings
    from mlx_kvserve.service.spec import build_spec

    flags = setting_flags(args)
    settings = load_settings(flags)  # a bad option or config file fails here, not in the log
    plan = manager.install(build_spec(args.name, flags, settings))
    secrets = [k for k in [settings.api_key or "", *settings.api_keys] if k]
    return dataclasses.replace(plan, secrets=secrets)  # masked when a dry run prints the plan
