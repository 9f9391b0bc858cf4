"""Serving: the instance's HTTP API (``instance_server``) and its process (``instance_main``),
``talaria serve`` (``serve``, its TOML configuration ``config`` and its command line
``cli``), and the supervisor that restarts a dead instance (``supervisor``)."""
