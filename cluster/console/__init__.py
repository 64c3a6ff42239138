"""The web console: the fleet at a glance and a chat playground, served by the router's
HTTP port at / (and a worker's, for itself). No separate process, nothing fetched at run
time from anywhere else: the page is plain HTML, CSS and JavaScript modules shipped in
this package (`static/`), with no build step.

- `state.py`: what the page shows, built from what the server already holds (the
  router's registry and load reports, groups and ranks, its recent-requests ring
  `cluster/router/recent.py`, the fleet's nodes and catalog when it has one).
- `hub.py`: live pushes (Server-Sent Events): one snapshot a second while a page listens,
  pushed only when it changed.
- `routes.py`: the page, its files, the state, the pushes and the operator's actions, with
  the API's keys (state: an API key when keys are set; actions: the admin key) and a
  strict Content-Security-Policy.
- `actions.py`: the router's actions (drain a worker; load, unload, pin a catalog model).

`orchard router serve --console off` serves none of it.
"""
