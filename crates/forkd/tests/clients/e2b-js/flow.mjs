// E2B's JavaScript SDKs (`e2b`, `@e2b/code-interpreter` from npm, unmodified) against
// forkd's E2B listener, pointed at it by E2B_API_URL, E2B_SANDBOX_URL and E2B_API_KEY
// alone. The template is the forkd snapshot FORKD_TEST_SNAPSHOT. Prints `ok`.

import assert from 'node:assert/strict'
import { createHash, randomBytes } from 'node:crypto'
import { CommandExitError, Sandbox, AuthenticationError, FileNotFoundError } from 'e2b'
import { Sandbox as CodeInterpreter } from '@e2b/code-interpreter'

const template = process.env.FORKD_TEST_SNAPSHOT
const run = `e2b js flow ${process.pid}`
const sha256 = (b) => createHash('sha256').update(b).digest('hex')

const sbx = await Sandbox.create(template, {
  timeoutMs: 600_000,
  metadata: { suite: run },
  envs: { GREETING: 'hi' },
})

// Commands: streamed output, the default user and its home, the sandbox's env.
const seen = []
const r = await sbx.commands.run('for i in 1 2 3; do echo line$i; sleep 0.2; done; echo oops >&2', {
  onStdout: (d) => seen.push(d),
})
assert.equal(r.exitCode, 0)
assert.equal(r.stdout, 'line1\nline2\nline3\n')
assert.equal(r.stderr, 'oops\n')
assert.equal(seen.join(''), r.stdout)
assert.ok(seen.length >= 2, `${seen}`)
assert.equal((await sbx.commands.run('echo "$GREETING $(whoami) $(pwd)"')).stdout, 'hi user /home/user\n')
assert.equal((await sbx.commands.run('whoami', { user: 'root' })).stdout, 'root\n')

// A failing command throws with its exit code.
await assert.rejects(sbx.commands.run('echo partial; exit 3'), (e) => {
  assert.ok(e instanceof CommandExitError, `${e}`)
  assert.equal(e.exitCode, 3)
  assert.equal(e.stdout, 'partial\n')
  return true
})

// A background command, listed, killed.
const h = await sbx.commands.run('sleep 600', { background: true })
assert.ok((await sbx.commands.list()).some((p) => p.pid === h.pid))
assert.equal(await h.kill(), true)
await assert.rejects(h.wait(), CommandExitError)

// stdin of a background command.
const cat = await sbx.commands.run('cat', { background: true, stdin: true })
await sbx.commands.sendStdin(cat.pid, 'first\n')
await sbx.commands.sendStdin(cat.pid, 'second\n')
await sbx.commands.closeStdin(cat.pid)
assert.equal((await cat.wait()).stdout, 'first\nsecond\n')

// Files.
await sbx.files.write('notes/a.txt', 'hello')
assert.equal(await sbx.files.read('/home/user/notes/a.txt'), 'hello')
const blob = randomBytes(10 * 1024 * 1024)
await sbx.files.write('/tmp/blob.bin', blob)
const got = await sbx.files.read('/tmp/blob.bin', { format: 'bytes' })
assert.equal(sha256(got), sha256(blob))
const entries = await sbx.files.list('notes')
assert.deepEqual(entries.map((e) => [e.name, e.type, e.size]), [['a.txt', 'file', 5]])
assert.equal(await sbx.files.exists('notes/a.txt'), true)
assert.equal(await sbx.files.exists('notes/none'), false)
assert.equal(await sbx.files.makeDir('d1/d2'), true)
assert.equal(await sbx.files.makeDir('d1/d2'), false)
const moved = await sbx.files.rename('notes/a.txt', 'notes/b.txt')
assert.equal(moved.path, '/home/user/notes/b.txt')
await sbx.files.remove('notes/b.txt')
await assert.rejects(sbx.files.read('notes/b.txt'), FileNotFoundError)

// A terminal (the PTY service): bash typed into, resized, and its exit code.
let screen = ''
const term = await sbx.pty.create({ cols: 80, rows: 24, onData: (d) => { screen += new TextDecoder().decode(d) } })
const shows = async (want) => {
  for (let i = 0; i < 300 && !screen.includes(want); i++) await new Promise((r) => setTimeout(r, 100))
  assert.ok(screen.includes(want), `the terminal never showed ${want}: ${screen}`)
}
const typed = (s) => sbx.pty.sendInput(term.pid, new TextEncoder().encode(s))
await typed('stty size\n')
await shows('24 80')
await sbx.pty.resize(term.pid, { cols: 100, rows: 30 })
await typed('stty size\n')
await shows('30 100')
await typed('exit 3\n')
const ended = await term.wait().catch((e) => e)
assert.ok(ended instanceof CommandExitError, String(ended))
assert.equal(ended.exitCode, 3)

// A directory watch (WatchDir): the events of a command, in order.
await sbx.files.makeDir('watched')
const watched = []
const watcher = await sbx.files.watchDir('watched', (e) => watched.push([e.type, e.name]), { recursive: true })
await sbx.commands.run('echo x > watched/j.txt; rm watched/j.txt')
for (let i = 0; i < 100 && !watched.some(([t]) => t === 'remove'); i++) {
  await new Promise((r) => setTimeout(r, 100))
}
await watcher.stop()
assert.deepEqual(watched, [['create', 'j.txt'], ['write', 'j.txt'], ['remove', 'j.txt']])

// Timeout, list by metadata.
await sbx.setTimeout(900_000)
const listed = await Sandbox.list({ query: { metadata: { suite: run } } }).nextItems()
assert.deepEqual(listed.map((s) => s.sandboxId), [sbx.sandboxId])
assert.deepEqual(listed[0].metadata, { suite: run })

// A wrong API key is refused.
await assert.rejects(
  Sandbox.list({ apiKey: 'e2b_' + '0'.repeat(40) }).nextItems(),
  AuthenticationError,
)

// Pause and resume: listed paused, back as it was through connect, and resumed by
// its next call when paused again.
await sbx.commands.run('sleep 600 >/dev/null 2>&1 & echo $! > /tmp/sleeper')
assert.equal(await sbx.pause(), true)
assert.equal(await Sandbox.pause(sbx.sandboxId), false)
assert.equal((await sbx.getInfo()).state, 'paused')
const pausedList = Sandbox.list({ query: { metadata: { suite: run }, state: ['paused'] } })
assert.deepEqual((await pausedList.nextItems()).map((s) => s.sandboxId), [sbx.sandboxId])
const back = await Sandbox.connect(sbx.sandboxId, { timeoutMs: 900_000 })
assert.equal((await back.getInfo()).state, 'running')
assert.equal((await back.commands.run('kill -0 $(cat /tmp/sleeper) && echo alive')).stdout, 'alive\n')
assert.equal(await sbx.pause(), true)
assert.equal(await sbx.files.exists('notes'), true)
assert.equal((await sbx.getInfo()).state, 'running')

await sbx.kill()
assert.equal(await Sandbox.kill(sbx.sandboxId), false)

// The code interpreter.
const ci = await CodeInterpreter.create(template)
try {
  await ci.runCode('x = 41')
  assert.equal((await ci.runCode('x + 1')).text, '42')
  const df = await ci.runCode("import pandas as pd\npd.DataFrame({'a': [1, 2]})")
  assert.match(df.results[0].html ?? '', /<table/)
  const fig = await ci.runCode('import matplotlib.pyplot as plt\nplt.plot([1, 2, 3])\nplt.show()')
  assert.ok(fig.results.some((x) => x.png), JSON.stringify(fig))
  const err = await ci.runCode('1 / 0')
  assert.equal(err.error?.name, 'ZeroDivisionError')
  const ctx = await ci.createCodeContext()
  await ci.runCode('y = 1', { context: ctx })
  assert.equal((await ci.runCode('y', { context: ctx })).text, '1')
} finally {
  await ci.kill()
}

console.log('ok')
