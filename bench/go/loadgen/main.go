// Command loadgen is the benchmark's grpc-go load generator: many job.Job
// subscribers in one process, cheap enough per message not to be the limit.
//
//	loadgen -target 127.0.0.1:PORT -count N [-connections C] [-stall K] [-sample-every S] [-deadline SECONDS]
//
// The N subscribers share C grpc.ClientConns (one TCP connection each),
// subscriber i on connection i mod C; -connections 0 gives every subscriber
// its own. Each registers, subscribes to SubscribeJobSummarySignal with
// grpc-go's defaults (BDP flow-control windows, no keepalive; only the
// receive limit is raised, as the Python load generator does) and counts what
// arrives. Messages are not decoded: the codec hands over the bytes. Every
// S-th message of a subscriber is decoded for its latency, the arrival time
// minus the publish time the server stamped into `sid` (Unix nanoseconds),
// as bench/loadgen.py measures it. The first K subscribers stop reading on
// the `stall` command; their messages are counted apart.
//
// It speaks the line protocol of every benchmark child (bench/common.py):
// one JSON line when ready, then one JSON reply per JSON command on stdin
// (count, lat_reset, lat_dump, stall, per_subscriber); it exits when stdin
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
	"strconv"
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

// The role of every benchmark subscriber (bench/common.py ROLE): no snapshot on subscribe.
const role = "CCAgent"

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

type load struct {
	target      string
	count       int
	connections int
	stall       int
	sampleEvery int64
	concurrency int

	received        []int64 // per subscriber, atomic
	stalledReceived int64
	started         int64
	failed          int64
	ended           int64
	stalled         int32

	errorsLock sync.Mutex
	errors     map[string]int

	latencyLock sync.Mutex
	latencies   []int64
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
	counter := &l.received[index]
	var message rawMessage
	var sample pb.JobSummarySignal
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
		if atomic.AddInt64(counter, 1)%l.sampleEvery != 0 {
			continue
		}
		arrival := time.Now().UnixNano()
		if proto.Unmarshal(message.data, &sample) != nil {
			continue
		}
		if sid, err := strconv.ParseInt(sample.Sid, 10, 64); err == nil {
			l.latencyLock.Lock()
			l.latencies = append(l.latencies, arrival-sid)
			l.latencyLock.Unlock()
		}
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

func (l *load) total() int64 {
	var sum int64
	for index := l.stall; index < l.count; index++ {
		sum += atomic.LoadInt64(&l.received[index])
	}
	return sum
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
		return map[string]interface{}{
			"received":         l.total(),
			"stalled_received": atomic.LoadInt64(&l.stalledReceived),
			"started":          atomic.LoadInt64(&l.started),
			"failed":           atomic.LoadInt64(&l.failed),
			"ended":            atomic.LoadInt64(&l.ended),
			"errors":           errors,
			"cpu_seconds":      cpuSeconds(),
		}
	case "per_subscriber":
		counts := make([]int64, 0, l.count-l.stall)
		for index := l.stall; index < l.count; index++ {
			counts = append(counts, atomic.LoadInt64(&l.received[index]))
		}
		return map[string]interface{}{"received": counts}
	case "lat_reset":
		l.latencyLock.Lock()
		l.latencies = l.latencies[:0]
		l.latencyLock.Unlock()
		return map[string]interface{}{"ok": true}
	case "lat_dump":
		path, _ := command["path"].(string)
		l.latencyLock.Lock()
		samples := append([]int64(nil), l.latencies...)
		l.latencyLock.Unlock()
		// Native int64s, as Python's array("q").tofile writes them (little-endian here).
		buffer := make([]byte, 8*len(samples))
		for i, value := range samples {
			binary.LittleEndian.PutUint64(buffer[8*i:], uint64(value))
		}
		if err := os.WriteFile(path, buffer, 0o600); err != nil {
			return map[string]interface{}{"error": err.Error()}
		}
		return map[string]interface{}{"samples": len(samples)}
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
	flag.Float64Var(&deadline, "deadline", 600, "seconds until the process exits, whatever it is doing")
	flag.Parse()
	if l.target == "" || l.count < 1 || l.sampleEvery < 1 || l.concurrency < 1 {
		fmt.Fprintln(os.Stderr, "loadgen: -target, -count >= 1, -sample-every >= 1, -concurrency >= 1")
		os.Exit(2)
	}
	childproc.StopByItself(time.Duration(deadline * float64(time.Second)))
	l.received = make([]int64, l.count)
	conns := l.start()
	childproc.Emit(map[string]interface{}{"ready": true, "pid": os.Getpid()})
	childproc.AnswerCommands(l.handle)
	for _, conn := range conns {
		conn.Close()
	}
}
