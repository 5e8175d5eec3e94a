"""The TCP mesh: every pair of ranks connected and authenticated (:mod:`.rendezvous`,
:mod:`.handshake`), messages framed on each link and drained into the rank's mailbox by one
reader thread per peer (:mod:`.framing`), goodbyes and aborts (:mod:`.teardown`), and
:class:`~.tcp.TcpBackend`, which puts them together; :mod:`.route` is how a faster path to some
peers (the same-host engine's rings) plugs in."""
