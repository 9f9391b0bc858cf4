"""The router: OpenAI-compatible front door with session-aware placement.

``router.core.RouterCore`` (placement + forwarding, no HTTP) is what the replay driver uses
in-process; ``router.app.create_app`` wraps it in the aiohttp API.

May import only ``talaria.protocol`` from the rest of Talaria (never ``engine``): it speaks to
instances through the protocol types, over HTTP live or by direct call in simulation.
"""
