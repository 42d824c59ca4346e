"""Running the server in the background: a launchd LaunchAgent on macOS, a systemd user unit on
Linux. `spec` decides what runs, `launchd`/`systemd` what to write and which commands to run,
`actions` applies that (or prints it for --dry-run), and `runner` is the only code that executes
launchctl, systemctl or journalctl."""
