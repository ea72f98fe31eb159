"""The gpufeed Python package as a user would run it (as another uid, under setpriv): attach to
a tokens file and read the first batch. Prints one JSON line: {"read": BYTES, "sha256": ...}
or {"code": CODE_NAME, "message": ...}.

    python3 pyclient.py SOCKET DATASET SEQ_LEN
"""

import hashlib
import json
import sys

import gpufeed

socket, dataset, seq_len = sys.argv[1], sys.argv[2], int(sys.argv[3])
try:
    with gpufeed.Client(socket).attach(dataset, kind="tokens", token_dtype="uint16",
                                       seq_len=seq_len, batch_size=1, shuffle=False,
                                       job="pyclient") as session:
        with session.next(timeout=10) as batch:
            data = batch.numpy()["tokens"].tobytes()
        print(json.dumps({"read": len(data), "sha256": hashlib.sha256(data).hexdigest()}))
except gpufeed.Error as e:
    print(json.dumps({"code": e.code_name, "message": str(e)}))
