"""The weights room: how a version travels from the learner's lanes into every server that serves it.

- ``manifest``: a weights directory's manifest and digest, ``verify``, and the weights this process
  holds in memory (``HELD``);
- ``tensorfiles``: weights directories written once, hashed while written;
- ``publish``: the learner-side publication (serving dtype, a directory per version, pruning);
- ``lease``: a version being read is never pruned;
- ``transfer``, ``server``, ``vllm_plugin``: weights pushed over a collective (gloo, NCCL) into vLLM;
- ``transports``: what a client can take (Protocols) and how a version gets into it;
- ``follower``: the component a policy or judge agent owns to follow its lane's announcements.

Between ``inference`` (below: the clients it loads into) and ``agents``/``training`` (above: the
owners of followers and publishers); an import contract keeps it there.
"""
