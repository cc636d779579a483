"""The wire room: the contracts the capture plane's servers and clients share, so that no sibling
reaches sideways into another for them: bearer-token auth (`auth`), JSON size and depth limits
(`limits`) and their aiohttp parsing (`web_json`), the own-metrics route (`metrics_http`), and the
names the operator gives and the gateway routes by (`labels`). The bottom layer of the plane:
it imports nothing first-party."""
