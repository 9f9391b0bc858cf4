"""The router's side of its instances: clients (HTTP, in-process), their health and state
polls, waits and deadlines, KV room, and the placement policies that rank them."""
