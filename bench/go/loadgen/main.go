// Command loadgen is the benchmark's grpc-go load generator: many job.Job
// subscribers in one process, cheap enough per message not to be the limit.
//
//	loadgen -target 127.0.0.1:PORT -count N [-connections C] [-stall K] [-sample-every S]
//	        [-fdagent-every F] [-deadline SECONDS]
//
// The N subscribers share C grpc.ClientConns (one TCP connection each),
// subscriber i on connection i mod C; -connections 0 gives every subscriber
// its own. Each registers, subscribes to SubscribeJobSummarySignal with
// grpc-go's defaults (BDP flow-control windows, no keepalive; only the
// receive limit is raised, as the Python load generator does) and counts what
// arrives. Every subscriber has role CCAgent, but with -fdagent-every F every
// F-th is an FdAgent (the role a server sends a snapshot of every job first).
//
// Messages are not decoded: the codec hands over the bytes, and only `sid`
// (field 15) is read from them, by walking the fields (each a length-delimited
// string). A `sid` that is a Unix time in nanoseconds is the time of the
// event: the publish time a server's in-process driver stamped, or the
// ConfigMap write time the benchmark's cluster stamped. Any other `sid` (the
// cluster's initial population writes "0") marks a message of a snapshot:
// those are counted apart, also when they arrive after a live message on the
// same stream (a snapshot that came late). Every S-th live message of a
// subscriber is a latency sample: its arrival time and arrival minus `sid`,
// as bench/loadgen.py measures it. The first K subscribers stop reading on
// the `stall` command; their messages are counted apart.
//
// It speaks the line protocol of every benchmark child (bench/common.py):
// one JSON line when ready, then one JSON reply per JSON command on stdin
// (count, lat_reset, lat_dump, samples_dump, stall, per_subscriber); it exits when stdin
// closes, when its parent dies, or at its deadline. `count` carries the
// process's own CPU time (getrusage), so the report can show what each
// received message cost the load generator.
package main

import (
	"context"
	"encoding/binary"
	"flag"
	"fmt"
	"io"
	"os"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/encoding"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	"jobsignalbench/childproc"
	pb "jobsignalbench/job"
)

// The role of the benchmark's subscribers (bench/common.py ROLE): no snapshot on
// subscribe; every -fdagent-every'th has snapshotRole.
const (
	role         = "CCAgent"
	snapshotRole = "FdAgent"
)

// A `sid` below this is no Unix time in nanoseconds (2001-09-09): a snapshot's.
const firstStamp = 1_000_000_000_000_000_000

// maxMessageBytes matches bench/common.py MAX_MESSAGE_BYTES.
const maxMessageBytes = 64 * 1024 * 1024

// -- a codec that does not decode ------------------------------------------------

// rawMessage receives a stream message's bytes undecoded.
type rawMessage struct{ data []byte }

// countingCodec replaces grpc-go's "proto" codec in this process: requests are
// marshalled as usual, stream messages received into a *rawMessage are not
// decoded (grpc-go allocates a fresh buffer per message, so keeping it is safe).
type countingCodec struct{}

func (countingCodec) Name() string { return "proto" }

func (countingCodec) Marshal(v interface{}) ([]byte, error) {
	return proto.Marshal(v.(proto.Message))
}

func (countingCodec) Unmarshal(data []byte, v interface{}) error {
	if raw, ok := v.(*rawMessage); ok {
		raw.data = data
		return nil
	}
	return proto.Unmarshal(data, v.(proto.Message))
}

func init() {
	// Runs after grpc-go's own registration (imported packages initialise first).
	encoding.RegisterCodec(countingCodec{})
}

// -- the load --------------------------------------------------------------------

// counters of one subscriber, atomic.
type counters struct {
	received          int64 // every message
	snapshot          int64 // of them, snapshot messages
	snapshotAfterLive int64 // of those, the ones that came after a live message
	live              int64 // live messages
}

type load struct {
	target       string
	count        int
	connections  int
	stall        int
	sampleEvery  int64
	concurrency  int
	fdagentEvery int

	subscribers     []counters
	stalledReceived int64
	started         int64
	failed          int64
	ended           int64
	stalled         int32

	errorsLock sync.Mutex
	errors     map[string]int

	latencyLock sync.Mutex
	samples     []int64 // pairs: arrival (Unix ns), latency (ns)
}

// stringField is the value of the length-delimited field `number` of a protobuf
// message, read without decoding the rest (nil if absent or malformed).
func stringField(data []byte, number uint64) []byte {
	for len(data) > 0 {
		tag, n := binary.Uvarint(data)
		if n <= 0 {
			return nil
		}
		data = data[n:]
		switch tag & 7 {
		case 0:
			if _, n = binary.Uvarint(data); n <= 0 {
				return nil
			}
			data = data[n:]
		case 1, 5:
			size := 8
			if tag&7 == 5 {
				size = 4
			}
			if len(data) < size {
				return nil
			}
			data = data[size:]
		case 2:
			length, n := binary.Uvarint(data)
			if n <= 0 || uint64(len(data)-n) < length {
				return nil
			}
			value := data[n : n+int(length)]
			if tag>>3 == number {
				return value
			}
			data = data[n+int(length):]
		default:
			return nil
		}
	}
	return nil
}

// stamp is a decimal `sid` as a number (0 if it is not one).
func stamp(sid []byte) int64 {
	var value int64
	if len(sid) == 0 || len(sid) > 19 {
		return 0
	}
	for _, c := range sid {
		if c < '0' || c > '9' {
			return 0
		}
		value = value*10 + int64(c-'0')
	}
	return value
}

func (l *load) roleOf(index int) string {
	if l.fdagentEvery > 0 && index%l.fdagentEvery == l.fdagentEvery-1 {
		return snapshotRole
	}
	return role
}

func (l *load) fail(err error) {
	name := status.Code(err).String()
	l.errorsLock.Lock()
	l.errors[name]++
	l.errorsLock.Unlock()
}

func (l *load) subscriber(index int, conn *grpc.ClientConn, gate chan struct{}) {
	gate <- struct{}{}
	client := pb.NewJobClient(conn)
	role := l.roleOf(index)
	// wait_for_ready: a connection refused or reset while many clients connect
	// at once is retried instead of failing the call.
	registerCtx, cancel := context.WithTimeout(context.Background(), 120*time.Second)
	reply, err := client.Register(registerCtx, &pb.ClientInfo{Role: role}, grpc.WaitForReady(true))
	cancel()
	var stream pb.Job_SubscribeJobSummarySignalClient
	if err == nil {
		stream, err = client.SubscribeJobSummarySignal(
			context.Background(),
			&pb.ClientInfo{Role: role, ClientId: reply.ClientId},
			grpc.WaitForReady(true),
		)
	}
	<-gate
	if err != nil {
		l.fail(err)
		atomic.AddInt64(&l.failed, 1)
		return
	}
	atomic.AddInt64(&l.started, 1)
	stallable := index < l.stall
	counter := &l.subscribers[index]
	var message rawMessage
	for {
		if err := stream.RecvMsg(&message); err != nil {
			if err != io.EOF {
				l.fail(err)
			}
			break
		}
		if stallable {
			atomic.AddInt64(&l.stalledReceived, 1)
			if atomic.LoadInt32(&l.stalled) != 0 {
				select {} // stop reading, for good
			}
			continue
		}
		atomic.AddInt64(&counter.received, 1)
		sid := stamp(stringField(message.data, 15))
		if sid < firstStamp {
			atomic.AddInt64(&counter.snapshot, 1)
			if atomic.LoadInt64(&counter.live) > 0 {
				atomic.AddInt64(&counter.snapshotAfterLive, 1)
			}
			continue
		}
		if atomic.AddInt64(&counter.live, 1)%l.sampleEvery != 0 {
			continue
		}
		arrival := time.Now().UnixNano()
		l.latencyLock.Lock()
		l.samples = append(l.samples, arrival, arrival-sid)
		l.latencyLock.Unlock()
	}
	atomic.AddInt64(&l.ended, 1)
}

func (l *load) start() []*grpc.ClientConn {
	connections := l.connections
	if connections <= 0 || connections > l.count {
		connections = l.count
	}
	conns := make([]*grpc.ClientConn, connections)
	for i := range conns {
		conn, err := grpc.Dial(
			l.target,
			grpc.WithInsecure(),
			grpc.WithDefaultCallOptions(grpc.MaxCallRecvMsgSize(maxMessageBytes)),
		)
		if err != nil {
			fmt.Fprintf(os.Stderr, "loadgen: dial %s: %v\n", l.target, err)
			os.Exit(2)
		}
		conns[i] = conn
	}
	gate := make(chan struct{}, l.concurrency)
	for index := 0; index < l.count; index++ {
		go l.subscriber(index, conns[index%connections], gate)
	}
	return conns
}

// -- commands ----------------------------------------------------------------------

func cpuSeconds() float64 {
	var usage syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &usage); err != nil {
		return -1
	}
	seconds := func(t syscall.Timeval) float64 { return float64(t.Sec) + float64(t.Usec)/1e6 }
	return seconds(usage.Utime) + seconds(usage.Stime)
}

// total: the messages (live, snapshot) the reading subscribers have received.
func (l *load) total() (int64, int64) {
	var received, snapshot int64
	for index := l.stall; index < l.count; index++ {
		received += atomic.LoadInt64(&l.subscribers[index].received)
		snapshot += atomic.LoadInt64(&l.subscribers[index].snapshot)
	}
	return received, snapshot
}

// dump writes int64s to path, little-endian (what Python's array("q") reads here).
func dump(path string, values []int64) map[string]interface{} {
	buffer := make([]byte, 8*len(values))
	for i, value := range values {
		binary.LittleEndian.PutUint64(buffer[8*i:], uint64(value))
	}
	if err := os.WriteFile(path, buffer, 0o600); err != nil {
		return map[string]interface{}{"error": err.Error()}
	}
	return map[string]interface{}{"samples": len(values)}
}

func (l *load) handle(command map[string]interface{}) map[string]interface{} {
	name, _ := command["cmd"].(string)
	switch name {
	case "count":
		l.errorsLock.Lock()
		errors := map[string]int{}
		for code, n := range l.errors {
			errors[code] = n
		}
		l.errorsLock.Unlock()
		received, snapshot := l.total()
		return map[string]interface{}{
			"received":         received,
			"snapshot":         snapshot,
			"stalled_received": atomic.LoadInt64(&l.stalledReceived),
			"started":          atomic.LoadInt64(&l.started),
			"failed":           atomic.LoadInt64(&l.failed),
			"ended":            atomic.LoadInt64(&l.ended),
			"errors":           errors,
			"cpu_seconds":      cpuSeconds(),
		}
	case "per_subscriber":
		// The reading subscribers in order: their counts and which are FdAgents.
		size := l.count - l.stall
		received := make([]int64, 0, size)
		snapshot := make([]int64, 0, size)
		late := make([]int64, 0, size)
		fdagent := make([]bool, 0, size)
		for index := l.stall; index < l.count; index++ {
			c := &l.subscribers[index]
			received = append(received, atomic.LoadInt64(&c.received))
			snapshot = append(snapshot, atomic.LoadInt64(&c.snapshot))
			late = append(late, atomic.LoadInt64(&c.snapshotAfterLive))
			fdagent = append(fdagent, l.roleOf(index) == snapshotRole)
		}
		return map[string]interface{}{
			"received": received, "snapshot": snapshot, "snapshot_after_live": late,
			"fdagent": fdagent,
		}
	case "lat_reset":
		l.latencyLock.Lock()
		l.samples = l.samples[:0]
		l.latencyLock.Unlock()
		return map[string]interface{}{"ok": true}
	case "lat_dump", "samples_dump":
		// lat_dump: the latencies; samples_dump: (arrival, latency) pairs.
		path, _ := command["path"].(string)
		l.latencyLock.Lock()
		samples := append([]int64(nil), l.samples...)
		l.latencyLock.Unlock()
		if name == "samples_dump" {
			return dump(path, samples)
		}
		latencies := make([]int64, 0, len(samples)/2)
		for i := 1; i < len(samples); i += 2 {
			latencies = append(latencies, samples[i])
		}
		return dump(path, latencies)
	case "stall":
		atomic.StoreInt32(&l.stalled, 1)
		return map[string]interface{}{"ok": true}
	}
	return map[string]interface{}{"error": fmt.Sprintf("unknown command %q", name)}
}

func main() {
	l := &load{errors: map[string]int{}}
	var deadline float64
	flag.StringVar(&l.target, "target", "", "server HOST:PORT")
	flag.IntVar(&l.count, "count", 1, "subscribers")
	flag.IntVar(&l.connections, "connections", 0, "connections they share (0: one each)")
	flag.IntVar(&l.stall, "stall", 0, "subscribers that stop reading on the stall command")
	flag.Int64Var(&l.sampleEvery, "sample-every", 10, "decode every n-th message of a subscriber for its latency")
	flag.IntVar(&l.concurrency, "concurrency", 100, "subscriptions being set up at once")
	flag.IntVar(&l.fdagentEvery, "fdagent-every", 0, "every n-th subscriber is an FdAgent (0: none)")
	flag.Float64Var(&deadline, "deadline", 600, "seconds until the process exits, whatever it is doing")
	flag.Parse()
	if l.target == "" || l.count < 1 || l.sampleEvery < 1 || l.concurrency < 1 {
		fmt.Fprintln(os.Stderr, "loadgen: -target, -count >= 1, -sample-every >= 1, -concurrency >= 1")
		os.Exit(2)
	}
	childproc.StopByItself(time.Duration(deadline * float64(time.Second)))
	l.subscribers = make([]counters, l.count)
	conns := l.start()
	childproc.Emit(map[string]interface{}{"ready": true, "pid": os.Getpid()})
	childproc.AnswerCommands(l.handle)
	for _, conn := range conns {
		conn.Close()
	}
}
