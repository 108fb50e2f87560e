// The SDK against a real daemon: FORKD_URL names it and FORKD_TEST_SNAPSHOT a snapshot
// of the python template on it (crates/forkd/tests/clients.rs starts both).
import assert from "node:assert/strict";
import { createHash, randomBytes } from "node:crypto";
import { Readable } from "node:stream";
import { after, before, describe, test } from "node:test";

import {
  BadRequestError,
  ConflictError,
  Connection,
  NotFoundError,
  Sandbox,
  Snapshot,
  TerminalClosedError,
  TimeoutError,
  UnreachableError,
} from "../dist/index.js";

const snapshot = process.env.FORKD_TEST_SNAPSHOT;
// A suite that quietly skips proves nothing: without a daemon it fails.
const noDaemon = () =>
  assert.ok(
    snapshot && process.env.FORKD_URL,
    "set FORKD_URL to a daemon and FORKD_TEST_SNAPSHOT to a python snapshot on it (cargo test -p forkd --test clients does both)",
  );

describe("a sandbox", () => {
  let sbx;
  before(async () => {
    noDaemon();
    sbx = await Sandbox.create("python", { snapshot, labels: { suite: "ts" } });
  });
  after(async () => {
    await sbx?.kill();
  });

  test("limits chosen at fork come back in the sandbox's info", async () => {
    const limited = await Sandbox.create("python", { snapshot, limits: { cpuCores: 0.5, pids: 64 } });
    try {
      const l = limited.info.limits;
      assert.deepEqual([l.cpuCores, l.pids, l.cpuWeight], [0.5, 64, 100]);
      assert.ok(l.memoryBytes > limited.info.memoryMib * 1024 * 1024);
    } finally {
      await limited.kill();
    }
  });

  test("a network policy chosen at fork comes back and changes while the child runs", async () => {
    const policy = { egress: "allow", allow: [], deny: ["203.0.113.0/24"] };
    const [child] = await Sandbox.fork(snapshot, 1, { network: { egress: "allow", deny: ["203.0.113.0/24"] } });
    try {
      assert.deepEqual(child.info.network, policy);
      assert.deepEqual((await Sandbox.connect(child.id)).info.network, policy);
      const off = { egress: "off", allow: [], deny: [] };
      assert.deepEqual((await child.setNetwork({ egress: "off" })).network, off);
      assert.deepEqual(child.info.network, off);
      assert.equal((await child.refresh()).network?.egress, "off");
    } finally {
      await child.kill();
    }
    // A deny-list means something only in allow mode: the daemon refuses it.
    await assert.rejects(
      Sandbox.create("python", { snapshot, network: { deny: ["203.0.113.0/24"] } }),
      (e) => e instanceof BadRequestError && /deny-list/.test(e.message),
    );
  });

  test("commands give output as bytes and text, and exit codes", async () => {
    const r = await sbx.commands.run("echo out; echo err >&2; exit 3");
    assert.deepEqual([r.exitCode, r.stdout, r.stderr], [3, "out\n", "err\n"]);
    const b = await sbx.commands.run(["sh", "-c", "printf '\\377\\000'"]);
    assert.deepEqual([...b.stdoutBytes], [0xff, 0]);
    const e = await sbx.commands.run("echo $A; pwd; wc -c", { envs: { A: "b" }, cwd: "/tmp", stdin: "12345" });
    assert.equal(e.stdout, "b\n/tmp\n5\n");
    const t = await sbx.commands.run("sleep 30", { timeout: 0.5 });
    assert.ok(t.timedOut);
  });

  test("streamed output arrives in pieces and whole", async () => {
    const out = [];
    const r = await sbx.commands.run("for i in 1 2 3; do echo l$i; sleep 0.2; done; printf '\\342\\202\\254'", {
      onStdout: (t) => out.push(t),
    });
    assert.equal(out.join(""), "l1\nl2\nl3\n\u20ac");
    assert.equal(r.stdout, out.join(""));
    assert.ok(out.length > 1);
  });

  test("background commands wait, take signals and are killed", async () => {
    const h = await sbx.commands.run("echo started; exec sleep 600", { background: true });
    assert.ok((await sbx.commands.list()).some((p) => p.id === h.id && p.running));
    await assert.rejects(h.wait(0.3), TimeoutError);
    await h.sendSignal(15);
    const ended = await h.wait();
    assert.deepEqual([ended.running, ended.signal, ended.exitCode, ended.stdout], [false, 15, 143, "started\n"]);
    const i = await sbx.commands.run(["sleep", "600"], { background: true });
    await i.sendSignal("SIGINT", { group: false });
    assert.deepEqual([(await i.wait()).signal], [2]);
    const k = await sbx.commands.run(["sleep", "600"], { background: true });
    assert.equal((await k.kill()).running, false);
    await assert.rejects(k.info(), NotFoundError);
  });

  test("background stdin is written in pieces, then closed", async () => {
    const h = await sbx.commands.run("cat; echo eof", { background: true, stdin: true });
    assert.equal((await h.info()).stdinOpen, true);
    const big = Buffer.alloc(700_000, 0xff);
    await h.sendStdin("a\n");
    await h.sendStdin(big);
    assert.equal((await h.closeStdin()).stdinOpen, false);
    const ended = await h.wait(60);
    assert.deepEqual(ended.stdoutBytes, Buffer.concat([Buffer.from("a\n"), big, Buffer.from("eof\n")]));
    await assert.rejects(h.sendStdin("late"), ConflictError);
    const given = await sbx.commands.run(["sha256sum"], { background: true, stdin: "abc" });
    const sum = createHash("sha256").update("abc").digest("hex");
    assert.equal((await given.wait(60)).stdout.split(" ")[0], sum);
  });

  test("files go both ways as text, bytes and streams", async () => {
    await sbx.files.write("/tmp/t.txt", "héllo\n");
    assert.equal(await sbx.files.read("/tmp/t.txt"), "héllo\n");
    const big = randomBytes(5 << 20);
    const info = await sbx.files.write("/tmp/big", Readable.from([big.subarray(0, 1 << 20), big.subarray(1 << 20)]), {
      mode: 0o600,
    });
    assert.equal(info.size, big.length);
    assert.equal(info.mode & 0o777, 0o600);
    const h = createHash("sha256");
    for await (const c of await sbx.files.read("/tmp/big", { format: "stream" })) h.update(c);
    assert.equal(h.digest("hex"), createHash("sha256").update(big).digest("hex"));
    await sbx.files.makeDir("/tmp/d/e");
    await sbx.files.rename("/tmp/t.txt", "/tmp/d/t.txt");
    assert.deepEqual((await sbx.files.list("/tmp/d")).map((e) => e.name).sort(), ["e", "t.txt"]);
    await sbx.files.remove("/tmp/d", { recursive: true });
    assert.equal(await sbx.files.exists("/tmp/d"), false);
    await assert.rejects(sbx.files.read("/nope/x"), NotFoundError);
    await assert.rejects(sbx.files.write("relative", "x"), BadRequestError);
  });

  test("code cells keep state, give values, errors and rich results", async () => {
    await sbx.runCode("x = 41");
    const x = await sbx.runCode("print('hi'); x + 1");
    assert.deepEqual([x.text, x.logs.stdout, x.error], ["42", ["hi\n"], null]);
    const e = await sbx.runCode("1 / 0");
    assert.equal(e.error?.name, "ZeroDivisionError");
    const results = [];
    const out = [];
    const d = await sbx.runCode("import pandas as pd\nprint('a')\npd.DataFrame({'n': [1]})", {
      onStdout: (t) => out.push(t),
      onResult: (r) => results.push(r),
    });
    assert.equal(out.join(""), "a\n");
    assert.match(results[0]?.html ?? "", /<table/);
    assert.deepEqual(d.results, results);
    await sbx.files.makeDir("/tmp/ts-watch");
    const seen = [];
    const watch = await sbx.files.watchDir("/tmp/ts-watch", (e) => seen.push([e.type, e.path]));
    await sbx.commands.run("echo x > /tmp/ts-watch/f; rm /tmp/ts-watch/f");
    for (let i = 0; i < 300 && !seen.some(([t]) => t === "remove"); i++) await new Promise((r) => setTimeout(r, 100));
    await watch.stop();
    assert.equal(watch.error, undefined);
    assert.deepEqual(seen, [["create", "/tmp/ts-watch/f"], ["write", "/tmp/ts-watch/f"], ["remove", "/tmp/ts-watch/f"]]);
    const probe = "import os; os.environ.get('RUN_ONLY', 'unset')";
    assert.equal((await sbx.runCode(probe, { envs: { RUN_ONLY: "this run" } })).text, "'this run'");
    assert.equal((await sbx.runCode(probe)).text, "'unset'");
    const ctx = await sbx.createCodeContext({ cwd: "/tmp" });
    assert.equal((await sbx.runCode("'x' in globals()", { context: ctx })).text, "False");
    await sbx.resetCodeContext(ctx);
    await sbx.removeCodeContext(ctx);
    assert.ok((await sbx.listCodeContexts()).every((c) => c.id !== ctx.id));
  });
});

describe("a terminal", () => {
  test("bash on a pty: typed into, resized, exits with its code; killed; bad sizes refused", async () => {
    noDaemon();
    const sbx = await Sandbox.create("python", { snapshot, labels: { suite: "ts-pty" } });
    try {
      let screen = "";
      const t = await sbx.pty.create({ cols: 80, rows: 24, cmd: ["bash"], envs: { PS1: "$ " }, onData: (d) => (screen += Buffer.from(d).toString("utf8")) });
      assert.ok(t.pid > 1);
      const until = async (want) => {
        for (let i = 0; i < 600 && !screen.includes(want); i++) await new Promise((r) => setTimeout(r, 50));
        assert.ok(screen.includes(want), `never saw ${want}: ${screen}`);
      };
      await t.sendInput("stty size\n");
      await until("24 80");
      await t.resize({ cols: 100, rows: 30 });
      await t.sendInput(new TextEncoder().encode("stty size\n"));
      await until("30 100");
      await t.sendInput("exit 3\n");
      assert.equal(await t.wait(), 3);

      const sleeper = await sbx.pty.create({ cmd: ["sleep", "600"] });
      sleeper.kill();
      await assert.rejects(sleeper.wait(), (e) => e instanceof TerminalClosedError && e.reason === "killed");
      await assert.rejects(sbx.pty.create({ cols: 0 }), BadRequestError);
    } finally {
      await sbx.kill();
    }
  });
});

describe("lifecycle", () => {
  test("create, list, connect, time out, branch, fork and remove", async () => {
    noDaemon();
    const label = randomBytes(4).toString("hex");
    const source = await Sandbox.create("python", {
      snapshot,
      labels: { run: label },
      timeout: 600,
      envs: { FORKD_RUN: label },
    });
    try {
      assert.equal((await source.commands.run("echo $FORKD_RUN")).stdout, `${label}\n`);
      assert.deepEqual((await Sandbox.list({ labels: { run: label } })).map((s) => s.id), [source.id]);
      const again = await Sandbox.connect(source.id);
      assert.notEqual(again.info.timeoutAt, null);
      await source.setTimeout(null);
      assert.equal((await source.refresh()).timeoutAt, null);
      await source.runCode("state = 'kept'");
      const tag = "ts-" + label;
      const snap = await source.branch({ tag });
      assert.equal(snap.info.parent, snapshot);
      await assert.rejects(source.branch({ tag }), ConflictError);
      const [child] = await snap.fork(1);
      assert.equal((await child.runCode("state")).text, "'kept'");
      // Paused and back through connect, with its memory; paused again, a call resumes it.
      await child.pause();
      assert.equal(child.info.status, "paused");
      await assert.rejects(child.pause(), ConflictError);
      const back = await Sandbox.connect(child.id);
      assert.equal(back.info.status, "running");
      assert.equal((await back.runCode("state")).text, "'kept'");
      await child.pause();
      assert.equal((await child.commands.run("echo back")).stdout, "back\n");
      await child.resume();
      assert.equal(child.info.status, "running");
      await child.kill();
    } finally {
      await source.kill();
    }
    assert.equal(await source.isRunning(), false);
    await assert.rejects(source.kill(), NotFoundError);
    const tag = "ts-" + label;
    assert.ok((await Snapshot.list()).some((s) => s.tag === tag));
    await (await Snapshot.get(tag)).delete();
    await assert.rejects(Snapshot.get(tag), NotFoundError);
    await assert.rejects(Sandbox.connect("sb-000000000000"), NotFoundError);
  });
});

test("a stopped daemon is an error naming the URL", async () => {
  const url = "unix:/nonexistent/forkd.sock";
  await assert.rejects(Sandbox.list({ connection: new Connection({ url }) }), (e) => {
    assert.ok(e instanceof UnreachableError, String(e));
    assert.ok(e.message.includes(url), e.message);
    return true;
  });
});
