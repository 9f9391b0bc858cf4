"""Agent-session traces: the format and its loader, readers of other formats, the session
generator, model assignment, and the development / report split."""
