"""The stores a job agrees in, and who may write them: below tandem.comm, whose
heartbeats land in them, and tandem.control, whose membership is kept in them.

- job_secret.py: the job secret, and a store whose keys and values only the
  job's members can make (Note [signed store]);
- listening_store.py: a TCP store that listens on the job's address only
  (Note [a store on the job's address]);
- etcd_gateway.py, etcd_store.py: a c10d store kept by an etcd cluster, through
  its JSON gateway, failing over between the members (Note [a store on etcd]);
- store_address.py: where a job's workers meet, a TCP store or a prefix on etcd,
  and how to reach either (Note [the workers' store on etcd]).

Standard library and torch.distributed only: the launcher reaches its stores
without importing the rest of tandem.
"""
