"""What the router knows of sessions: which session a call belongs to (named or inferred), its
KV chains and where its calls went, and the output lengths it has learned."""
