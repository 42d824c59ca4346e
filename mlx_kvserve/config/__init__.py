"""Settings: their declaration (settings), value parsing (values), the TOML file (file), the
command-line flags generated from them (flags) and the flags > env > file > defaults order
(precedence)."""
