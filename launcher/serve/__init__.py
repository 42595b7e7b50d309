"""The launcher's servers and their security: the bounded HTTP server every server uses
(``bounded_http.py``), the control API's authentication (``control_auth.py``), socket-owner
checks (``peer_uid.py``), the workers' routes (``coordinator_server.py``) and the control API
with its client and job file (``control.py``)."""
