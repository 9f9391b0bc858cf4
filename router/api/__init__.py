"""The router's three APIs (OpenAI chat and completions, Anthropic Messages, OpenAI Responses):
reading requests into one chat form, writing answers and streams, tools, limits on bodies."""
