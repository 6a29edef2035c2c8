"""tandem inside other frameworks' training loops, through the extension points
they document: ``lightning`` (Lightning's Trainer and Fabric strategies).

Each integration imports its framework, which tandem does not depend on: install
it with the matching extra (``pip install 'tandem[lightning]'``) and import the
integration explicitly; ``import tandem`` imports none of them.
"""
