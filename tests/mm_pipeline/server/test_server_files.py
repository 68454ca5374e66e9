"""Files API: the store's invariants under random operation sequences, and the HTTP routes with the
real openai client (uploads streamed, size-capped, deduplicated by content hash)."""

from __future__ import annotations

import blake3
import httpx
import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mm_pipeline.server import ServerSettings, ServerThread, create_app
from mm_pipeline.server.files.files_store import FileNotFoundInStore, FilesStore, UploadTooLarge


class _StatsOnlyEngine:
    """The files routes never generate; the app only needs a name and stats()."""

    model_name = "files-test"

    def __init__(self) -> None:
        self.resolver = None

    def set_file_resolver(self, fn) -> None:
        self.resolver = fn

    def stats(self) -> dict:
        return {}


# ---- store ----------------------------------------------------------------------------------------
ops = st.lists(st.one_of(
    st.tuples(st.just("put"), st.sampled_from([b"a", b"bb", b"ccc", b"a" * 300])),
    st.tuples(st.just("delete"), st.integers(0, 7)),
    st.tuples(st.just("reopen"), st.none()),
), max_size=25)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops)
def test_store_invariants_under_random_operations(tmp_path_factory, sequence):
    root = tmp_path_factory.mktemp("store")
    store = FilesStore(root, max_file_bytes=1000, max_total_bytes=1000)
    model: dict[str, bytes] = {}
    ids: list[str] = []
    for op, arg in sequence:
        if op == "put" and sum(map(len, model.values())) + len(arg) > 1000:  # duplicates count too
            with pytest.raises(UploadTooLarge, match="full"):
                store.put_bytes(arg, "x/y/name.bin")
        elif op == "put":
            rec = store.put_bytes(arg, "x/y/name.bin")
            assert rec.filename == "name.bin" and rec.bytes == len(arg)
            assert rec.content_hash == blake3.blake3(arg).hexdigest()
            model[rec.id] = arg
            ids.append(rec.id)
        elif op == "delete" and ids:
            fid = ids[arg % len(ids)]
            if fid in model:
                store.delete(fid)
                del model[fid]
            else:
                with pytest.raises(FileNotFoundInStore):
                    store.delete(fid)
        elif op == "reopen":
            store = FilesStore(root, max_file_bytes=1000, max_total_bytes=1000)
        store.check_integrity()
        assert {r.id for r in store.list()} == set(model)
        for fid, data in model.items():
            assert store.path(fid).read_bytes() == data
        # one blob per distinct content
        assert len(list((root / "blobs").iterdir())) == len(set(model.values()))


def test_store_caps(tmp_path):
    store = FilesStore(tmp_path, max_file_bytes=10, max_total_bytes=15)
    with pytest.raises(UploadTooLarge, match="10-byte"):
        store.put_bytes(b"x" * 11, "big")
    store.put_bytes(b"y" * 10, "a")
    with pytest.raises(UploadTooLarge, match="full"):
        store.put_bytes(b"z" * 10, "b")
    with pytest.raises(UploadTooLarge, match="full"):  # one blob on disk, but every id counts
        store.put_bytes(b"y" * 10, "same content again")
    with pytest.raises(ValueError, match="empty"):
        store.put_bytes(b"", "empty")
    store.check_integrity()
    assert len(store.list()) == 1 and store.total_bytes == 10


def test_store_caps_the_number_of_files(tmp_path):
    store = FilesStore(tmp_path, max_file_bytes=10, max_total_bytes=1000, max_files=3)
    for i in range(3):
        store.put_bytes(b"same", f"copy{i}")
    with pytest.raises(UploadTooLarge, match="3 files"):
        store.put_bytes(b"same", "one more")
    store.delete(store.list()[0].id)
    store.put_bytes(b"same", "room again")
    store.check_integrity()


# ---- HTTP ---------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def server(tmp_path_factory):
    engine = _StatsOnlyEngine()
    app = create_app(engine, ServerSettings(api_key="sk-test", files_dir=str(tmp_path_factory.mktemp("files")),
                                            max_upload_bytes=64 * 1024, max_files_total_bytes=1 << 20))
    with ServerThread(app) as srv:
        srv.engine, srv.store = engine, app.state.store
        yield srv


def _client(server, key="sk-test"):
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key=key, max_retries=0)


def test_upload_roundtrip_and_resolver(server):
    c = _client(server)
    payload = bytes(range(256)) * 100  # 25.6 kB, several parser chunks
    f = c.files.create(file=("dir/clip.mp4", payload), purpose="user_data")
    assert f.bytes == len(payload) and f.filename == "clip.mp4" and f.purpose == "user_data"
    assert f.id in [x.id for x in c.files.list().data]
    assert c.files.retrieve(f.id).bytes == len(payload)
    assert c.files.content(f.id).read() == payload
    path, name = server.engine.resolver(f.id)  # what the engine reads for a {"file": {"file_id"}} part
    assert path.read_bytes() == payload and name == "clip.mp4"
    again = c.files.create(file=("copy.mp4", payload), purpose="vision")
    assert again.id != f.id
    assert server.store.get(again.id).content_hash == server.store.get(f.id).content_hash
    assert c.files.delete(f.id).deleted
    assert c.files.content(again.id).read() == payload  # the shared blob survives one delete
    with pytest.raises(openai.NotFoundError) as e:
        c.files.retrieve(f.id)
    assert f.id in e.value.body["message"]
    c.files.delete(again.id)
    server.store.check_integrity()


def test_upload_errors(server):
    c = _client(server)
    with pytest.raises(openai.APIStatusError) as e:
        c.files.create(file=("big.bin", b"x" * (64 * 1024 + 1)), purpose="user_data")
    assert e.value.status_code == 413 and "limit" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError, match="purpose"):
        c.files.create(file=("a.bin", b"abc"), purpose="nonsense")
    with pytest.raises(openai.AuthenticationError):
        _client(server, key="wrong").files.list()
    h = {"Authorization": "Bearer sk-test"}
    r = httpx.post(server.base_url + "/v1/files", headers=h, json={"file": "abc"})
    assert r.status_code == 415 and r.json()["error"]["type"] == "unsupported_media_type"
    r = httpx.delete(server.base_url + "/v1/files/file-000000000000000000000000", headers=h)
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
    server.store.check_integrity()


def test_streamed_upload_is_cut_at_the_cap(server):
    """No Content-Length (chunked): the cap is enforced while the bytes arrive."""
    boundary = "b0undary"
    head = (f"--{boundary}\r\nContent-Disposition: form-data; name=\"purpose\"\r\n\r\nuser_data\r\n"
            f"--{boundary}\r\nContent-Disposition: form-data; name=\"file\"; filename=\"big.bin\"\r\n"
            f"Content-Type: application/octet-stream\r\n\r\n").encode()
    sent = 0

    def body():
        nonlocal sent
        yield head
        for _ in range(64):  # 4 MiB offered, cap is 64 KiB
            sent += 65536
            yield b"z" * 65536
        yield f"\r\n--{boundary}--\r\n".encode()

    r = httpx.post(server.base_url + "/v1/files", content=body(),
                   headers={"Authorization": "Bearer sk-test",
                            "Content-Type": f"multipart/form-data; boundary={boundary}"})
    assert r.status_code == 413
    assert server.store.list() == [] or all(f.filename != "big.bin" for f in server.store.list())
    server.store.check_integrity()


def _multipart(boundary: bytes, data: bytes, close: bool = True) -> bytes:
    body = b"--" + boundary + b'\r\nContent-Disposition: form-data; name="file"; filename="a.bin"\r\n\r\n' + data
    return body + (b"\r\n--" + boundary + b"--\r\n" if close else b"")


def _post_raw(server, body, boundary: bytes) -> httpx.Response:
    return httpx.post(server.base_url + "/v1/files", content=body,
                      headers={"Authorization": "Bearer sk-test",
                               "Content-Type": "multipart/form-data; boundary=" + boundary.decode()})


def test_malformed_multipart_is_a_400_and_stores_nothing(server):
    """A boundary outside RFC 2046's 1-70 characters is refused (python-multipart raised a bare
    FormParserError, a 500, past 256); a body that ends before its closing boundary is a truncated
    upload, not a file of the bytes that came (python-multipart's finalize does not check)."""
    before = server.store.list()
    r = _post_raw(server, _multipart(b"b" * 257, b"hello"), b"b" * 257)
    assert r.status_code == 400 and "boundary" in r.json()["error"]["message"]
    r = _post_raw(server, _multipart(b"b" * 71, b"hello"), b"b" * 71)
    assert r.status_code == 400
    full = _multipart(b"bb", b"hello world, the whole file")
    for cut in (full[:full.index(b"whole")], _multipart(b"bb", b"no closing boundary", close=False)):
        r = _post_raw(server, cut, b"bb")
        assert r.status_code == 400 and "truncated" in r.json()["error"]["message"], r.text
    for garbage in (b"garbage garbage", b"--bb\r\nfoo\r\n\r\n"):  # python-multipart's own words stay in the log
        r = _post_raw(server, garbage, b"bb")
        assert r.status_code == 400 and "does not parse" in r.json()["error"]["message"], r.text
        assert "Expected" not in r.text and "index" not in r.text, r.text
    assert server.store.list() == before
    server.store.check_integrity()


def test_form_fields_and_chunked_bodies_are_bounded(server):
    """Plain fields are held in memory: their number is capped, and a chunked body (no
    Content-Length) is counted against the upload cap as it arrives even when no byte of it is file."""
    fields = b"".join(b'--bb\r\nContent-Disposition: form-data; name="f%d"\r\n\r\nv\r\n' % i for i in range(40))
    r = _post_raw(server, fields + _multipart(b"bb", b"abc"), b"bb")
    assert r.status_code == 400 and "form fields" in r.json()["error"]["message"]

    def many_fields():  # 2 MiB of one field sent again and again, cap 64 KiB: refused at the cap
        for _ in range(64):
            yield b"".join(b'--bb\r\nContent-Disposition: form-data; name="purpose"\r\n\r\n%s\r\n' % (b"v" * 100)
                           for _ in range(200))
        yield b"--bb--\r\n"

    r = _post_raw(server, many_fields(), b"bb")
    assert r.status_code == 413, r.text
    server.store.check_integrity()


def test_the_file_list_pages_as_openais(server):
    """Newest first by default, ``limit`` / ``after`` / ``order`` as OpenAI's list takes them (every
    file came back at once, oldest first, whatever was asked); bad values are a 400 naming them."""
    auth = {"Authorization": "Bearer sk-test"}
    ids = [_client(server).files.create(file=(f"p{i}.bin", b"page %d" % i), purpose="assistants").id for i in range(3)]
    listed = lambda **q: httpx.get(server.base_url + "/v1/files", params={"purpose": "assistants", **q},  # noqa: E731
                                   headers=auth).json()
    everything = listed()
    assert [f["id"] for f in everything["data"]] == ids[::-1] and everything["has_more"] is False
    first = listed(limit=2)
    assert [f["id"] for f in first["data"]] == ids[:0:-1] and first["has_more"] is True
    assert (first["first_id"], first["last_id"]) == (ids[2], ids[1])
    rest = listed(limit=2, after=first["last_id"])
    assert [f["id"] for f in rest["data"]] == [ids[0]] and rest["has_more"] is False
    assert [f["id"] for f in listed(order="asc")["data"]] == ids
    for bad in ({"limit": 0}, {"limit": 10_001}, {"limit": "abc"}, {"order": "bogus"}):
        r = httpx.get(server.base_url + "/v1/files", params=bad, headers=auth)
        assert r.status_code == 400 and r.json()["error"]["param"] == next(iter(bad)), (bad, r.text)
    c = _client(server)  # the SDK's cursor walks every page
    assert {f.id for f in c.files.list(purpose="assistants", limit=1)} == set(ids)
    for i in ids:
        c.files.delete(i)


def test_an_unknown_id_is_quoted_back_cut_short(server):
    """A 404 quotes the id it did not find, cut to 100 characters: an id of 5,000 came back whole."""
    auth = {"Authorization": "Bearer sk-test"}
    for path in ("/v1/files/", "/v1/files/{}/content", "/v1/batches/"):
        url = server.base_url + (path.format("f" * 5000) if "{}" in path else path + "f" * 5000)
        r = httpx.get(url, headers=auth) if "batches" in path or "content" in path else httpx.delete(url, headers=auth)
        assert r.status_code == 404 and len(r.json()["error"]["message"]) < 200, (path, r.status_code, len(r.text))


def test_content_of_a_file_deleted_while_it_is_asked_for_is_a_404(server):
    """The record was found, then a concurrent delete removed the blob before the download read it:
    a 404 (FileResponse's own stat raised RuntimeError, a 500)."""
    rec = server.store.put_bytes(b"soon gone", "gone.bin")
    server.store.path(rec.id).unlink()  # what the racing DELETE did between the lookup and the read
    r = httpx.get(server.base_url + f"/v1/files/{rec.id}/content", headers={"Authorization": "Bearer sk-test"})
    assert r.status_code == 404 and rec.id in r.json()["error"]["message"]
    server.store.delete(rec.id)
    server.store.check_integrity()


def test_upload_deleted_while_a_request_reads_it_is_not_found(tmp_path):
    """A DELETE /v1/files between a request's lookup of the id and its read of the bytes: the same
    404 (MediaNotFound) as an id deleted before, not a 500."""
    import types

    from mm_pipeline.encode.plan import PlannerConfig
    from mm_pipeline.encode.planner import MediaPlanner
    from mm_pipeline.errors import MediaNotFound
    from mm_pipeline.server.errors import http_answer

    store = FilesStore(tmp_path)
    record = store.put_bytes(b"\x89PNG\r\n\x1a\n" + bytes(100), "a.png")
    path, _name = store.resolve(record.id)  # what the planner's lookup returns
    store.delete(record.id)  # the owner deletes the file meanwhile
    with pytest.raises(MediaNotFound, match=record.id):
        MediaPlanner._read_upload(types.SimpleNamespace(config=PlannerConfig()), path, record.id)
    assert http_answer(MediaNotFound).status == 404
