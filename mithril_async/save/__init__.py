"""The save side: one save's protocol (:mod:`.job`), what saves share (:mod:`.context`), the
snapshot (:mod:`.snapshot`, :mod:`.staging`, :mod:`.stream_snapshot`, :mod:`.overlap`), the blob
writers (:mod:`.writers`, :mod:`.chunks`), delta chains (:mod:`.xor_chain`,
:mod:`.xor_choice`) and the commit (:mod:`.commit`)."""
